"""The training loop: schedule -> step -> log -> eval -> save, with resume and a SIGTERM save.

One iteration = the micro-batches of the global batch through the layout's schedule
(``parallel/pipeline/schedules.py``: gradient accumulation at pp = 1, 1F1B across pipeline
stages, interleaved 1F1B over virtual stages), each through the DeepSpeed engine (forward,
backward, step per micro-batch; DeepSpeed steps the optimizer at the accumulation boundary).
The FP8 backend's amax reduction runs after each micro-batch (under pipelining: after each
forward and each backward, per scaling role).
"""

from __future__ import annotations

import logging
import math
import os
import sys

import torch.distributed as dist

from megafp8 import checkpoint, metrics, train_log
from megafp8.build import Run, build_run, check_inputs, init_distributed
from megafp8.cli import dump_yaml, parse_args
from megafp8.config import Config
from megafp8.config_values import (
    batch_size_at,
    data_parallel_size,
    global_batch_size,
)
from megafp8.fp8.overflow_guard import Fp8OverflowGuard
from megafp8.model.moe import moe_metrics, update_expert_bias
from megafp8.optim.schedule import learning_rate
from megafp8.optim.step_guard import StepPolicy
from megafp8.optim.zero import set_lr
from megafp8.parallel.pipeline.schedules import forward_only, train_iteration
from megafp8.run_hooks import (
    RunHooks,
    Signals,
    check_launch,
    end_process,
    exit_status,
    launch_env,
    preflight,
    reach_master,
)
from megafp8.run_state import lrs, resume, save, schedule_steps
from megafp8.validate import validate
from megafp8.validate_data import check_batches

log = logging.getLogger("megafp8")


def train_step(run: Run, train_iter, hooks=None) -> tuple[float, float | None]:
    """One iteration (all micro-batches of the global batch) through the layout's schedule
    (``parallel/pipeline/schedules.py``); returns (DP-mean loss, grad norm), on every rank.

    The loss of a micro-batch is the mean over its counted tokens; the iteration's is the mean
    of those. With ``calculate_per_token_loss`` it is instead the sum over every counted token of
    the global batch (all micro-batches, all DP ranks) over their number: each micro-batch's
    loss is weighted by its token count before the backward (DeepSpeed divides by the
    accumulation steps and averages over DP, which the weight undoes)."""
    set_lr(run.engine, *lrs(run.cfg, schedule_steps(run)))
    out = train_iteration(run, train_iter, hooks)
    m = run.cfg.model
    if m.moe_router_enable_expert_bias:  # aux-loss-free balancing: after the step
        update_expert_bias(run.model, run.groups.tp_dp_group, m.moe_router_bias_update_rate)
    return out


def evaluate(run: Run, iters: int, split: str = "valid", start: int = 0) -> float | None:
    """The mean loss of ``iters`` global batches of ``split`` from its sample ``start``, each of
    the full global batch (under a ramp-up too, as Megatron-LM evaluates)."""
    it = run.data.eval_iterator(split, start)
    if it is None:
        return None
    run.model.eval()
    run.backend.microbatch(None)
    g = run.groups
    micro = global_batch_size(run.cfg, g.dp) // (run.cfg.train.micro_batch_size * g.dp)
    batches = []
    try:
        for _ in range(iters * micro):
            batches.append(next(it))
    except StopIteration:
        log.warning(
            "%s split: %d of the %d micro-batches from sample %d; the evaluation averages those",
            split,
            len(batches),
            iters * micro,
            start,
        )
    try:
        return forward_only(run, batches) if batches else None
    finally:
        run.model.train()


def eval_start(cfg: Config, dp: int, evals_before: int) -> int:
    """Megatron-LM's validation stream: each evaluation reads the ``eval_iters`` global batches
    after the previous one's, so evaluation ``k`` (0-based) starts at ``k x eval_iters x gbs``
    (the validation split is sized for every periodic one and the one at the end)."""
    return evals_before * cfg.train.eval_iters * global_batch_size(cfg, dp)


def train(cfg: Config, run: Run | None = None) -> list[dict]:
    """Run the loop; returns one record per logged iteration (on every rank)."""
    if run is None:
        groups, device = init_distributed(cfg)
        run = build_run(cfg, groups, device)
    cfg = run.cfg
    t, lg = cfg.train, cfg.logging
    rank0 = run.groups.rank == 0
    _attach_policies(run, rank0)
    if t.load:
        resume(run)
        errors: list[str] = []  # a step schedule's batches still due must fit this layout
        check_batches(cfg, run.groups.dp, run.consumed, errors)
        if errors:
            raise ValueError(f"at {run.consumed} consumed samples: {errors[0]}")
    dp = run.groups.dp
    if rank0:
        for d in (t.save, lg.tensorboard_dir):
            if d:
                os.makedirs(d, exist_ok=True)
                checkpoint.write_atomic(os.path.join(d, "config.yaml"), dump_yaml(cfg))
    tb = metrics.TensorBoard(lg.tensorboard_dir, rank0)
    tb.text("config", "```\n" + dump_yaml(cfg) + "\n```")
    fresh = {"iters": 0, "samples": 0, "flops": 0.0, "loss": 0.0, "losses": 0}
    since = dict(fresh)  # since the last console line
    peak = metrics.peak_tflops(cfg.fp8.enabled)
    world = dist.get_world_size() if dist.is_initialized() else 1
    train_iter, signals, history = iter(run.data.train), Signals(), []
    timer = metrics.Timer()
    hooks = RunHooks(cfg, run.groups.rank)
    try:  # a raise in the loop still unfreezes the collector, re-enables it, closes the trace
        timer.start(sync=True)
        first = True  # this process's first iteration gets a line of its own, as in Megatron-LM
        while run.iteration < t.train_iters:
            hooks.before_step(run.iteration + 1)
            logs = (run.iteration + 1) % lg.log_interval == 0 or run.iteration + 1 == t.train_iters
            fp8_stats = lg.log_fp8_stats and logs
            if fp8_stats:
                run.backend.start_fp8_stats()
            gbs = batch_size_at(cfg, dp, run.consumed)  # the full one, or a ramp-up's
            if gbs != run.engine.train_batch_size():
                run.engine.set_train_batch_size(gbs)  # its accumulation steps
            loss, gnorm = train_step(run, train_iter, hooks)
            if fp8_stats:
                tb.scalars(train_log.fp8_stats(run), run.iteration + 1)
            run.iteration += 1
            run.consumed += gbs  # a skipped iteration consumed its batch too (Megatron's)
            verdict = run.policy.verdict
            run.skipped_samples += gbs if verdict["skipped"] else 0
            since["iters"] += 1
            since["samples"] += gbs
            since["flops"] += metrics.flops_per_iteration(cfg.model, gbs, run.model.padded_vocab)
            if not verdict["skipped"]:  # the console's lm loss: the mean of the interval's updates
                since["loss"] += loss
                since["losses"] += 1
            if verdict["nan"] and run.policy.stop:
                raise FloatingPointError(f"{verdict['what']} at iteration {run.iteration}")
            if run.fp8_guard is not None:
                run.fp8_guard.after_iteration(run.iteration)
            rec = {
                "iteration": run.iteration,
                "lm loss": loss,
                "grad norm": gnorm,
                "skipped": verdict["skipped"],
                "global batch size": gbs,
                # as Megatron-LM's line: the lr the schedule holds after this step (the next one's)
                "learning rate": learning_rate(cfg.optim, schedule_steps(run), t.train_iters),
            }
            line = run.iteration % lg.log_interval == 0 or run.iteration == t.train_iters
            extra, first = first and not line, False  # the first line: the sums are not reset, so
            if line or extra:  # the interval's line still covers the whole interval (Megatron's)
                elapsed = timer.elapsed()
                dt = elapsed / since["iters"]
                tflops = since["flops"] / elapsed / world / 1e12
                rec["elapsed time per iteration (ms)"] = dt * 1e3
                if lg.log_throughput:
                    rec["tokens per second"] = since["samples"] * cfg.model.seq_length / elapsed
                    rec["throughput per GPU (TFLOP/s/GPU)"] = tflops
                    rec["MFU (%)"] = 100.0 * tflops / peak if peak else None
                rec["peak memory (GB)"] = metrics.peak_memory_gb() if lg.log_memory else None
                # every iteration of the interval skipped: the last one's loss (a NaN, the spike)
                rec["interval lm loss"] = (
                    since["loss"] / since["losses"] if since["losses"] else loss
                )
                train_log.log_line(run, rec, gbs, tb, rank0, reset=line)
                if cfg.model.num_experts:
                    tb.scalars(train_log.gather_pp(run, moe_metrics(run.model)), run.iteration)
                if line:
                    since = dict(fresh)
                    timer.start()
            history.append(rec)
            hooks.after_step(run.iteration)
            if t.eval_interval and run.iteration % t.eval_interval == 0:
                hooks.before_eval_or_save()
                _eval_and_log(run, tb, rank0, "valid", run.iteration // t.eval_interval - 1)
            deadline = hooks.deadline_passed()
            interval = bool(t.exit_interval) and run.iteration % t.exit_interval == 0
            stop = signals.any(run.device, deadline) or interval  # the same iteration on every rank
            if t.save and (
                (t.save_interval and run.iteration % t.save_interval == 0)
                or stop
                or run.iteration == t.train_iters
            ):
                hooks.before_eval_or_save()
                save(run)
            if stop:
                why = "signal received" if signals.hit else "exit duration reached"
                why = "exit interval reached" if interval and not signals.hit else why
                done = "saved" if t.save else "not saved"
                log.warning("%s: %s at iteration %d, exiting", why, done, run.iteration)
                break
        else:  # the last iteration reached: Megatron-LM's evaluations at the end of training
            if t.eval_interval and t.eval_iters:
                hooks.before_eval_or_save()
                _eval_and_log(
                    run, tb, rank0, "valid", t.train_iters // t.eval_interval, " on validation set"
                )
                _eval_and_log(run, tb, rank0, "test", 0, " on test set")
    finally:
        hooks.close()
        tb.close()
    return history


def _attach_policies(run: Run, rank0: bool) -> None:
    """The bad-step policy (NaN, spikes) and, with FP8, the overflow guard (README, Bad steps)."""
    if run.policy is None:
        run.policy = StepPolicy(run.cfg.train, run.engine)
    if run.fp8_guard is None and run.backend.fp8:
        n = run.cfg.fp8.fp8_overflow_fallback_steps
        layers = run.cfg.model.num_layers
        run.fp8_guard = Fp8OverflowGuard(run.backend, run.model, layers, n, rank0, run.device)


def _eval_and_log(
    run: Run, tb, rank0: bool, split: str, evals_before: int, where: str = ""
) -> None:
    """One evaluation and Megatron-LM's console line; ``where`` names the split at the end of
    training (" on validation set", " on test set"), as its line does."""
    start = eval_start(run.cfg, run.groups.dp, evals_before)
    v = evaluate(run, run.cfg.train.eval_iters, split, start)
    if v is not None and rank0:
        ppl = math.exp(min(v, 20.0))
        log.info(
            "validation loss at iteration %d%s | lm loss value: %.6E | lm loss PPL: %.6E |",
            run.iteration,
            where,
            v,
            ppl,
        )
        tag = "test" if split == "test" else "validation"
        if not where or split == "test":  # the periodic curve; the end's validation is console
            tb.scalars({f"{tag}/lm loss": v, f"{tag}/lm loss PPL": ppl}, run.iteration)


def setup_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        stream=sys.stdout,
        format="%(message)s",
        force=True,
    )


def main(argv=None) -> int:
    """Parse, check, train; the exit status is 0, 2 for bad input (one ``error:`` line), or
    ``run_hooks.EXIT_REQUEUE`` when a signal stopped the run after a save (requeue to resume)."""
    try:
        cfg = parse_args(argv)
        env = launch_env()  # torchrun, an srun task or one process
        check_launch(cfg, env)
        validate(cfg, env.world)
        check_inputs(cfg, env.world)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    env.export()
    if env.world > 1 and os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        try:  # an unreachable rendezvous is one line, not a hang until the collective timeout
            reach_master(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), env.rank)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    setup_logging(env.rank)
    log.info(
        "data-parallel size %d, tp %d, pp %d",
        data_parallel_size(cfg, env.world),
        cfg.parallel.tensor_model_parallel_size,
        cfg.parallel.pipeline_model_parallel_size,
    )
    groups, device = init_distributed(cfg)
    if env.world > 1:
        try:
            preflight(device, env.rank, env.world)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    run = build_run(cfg, groups, device)
    train(cfg, run)
    status = exit_status(run.cfg, run.iteration, env.rank)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return status


if __name__ == "__main__":
    end_process(main())
