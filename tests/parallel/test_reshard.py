"""--ckpt-format torch_dist: a checkpoint saved at (tp, pp, dp, zero) = (2, 1, 2, 2) loads into
(1, 1, 4, 1), (4, 1, 1, 3), (1, 2, 2, 1) and (1, 2, 2, 1) with 2 virtual stages, and back; the
next 5 losses equal those of the uninterrupted run (fp32: the layouts sum in other orders, 1e-6
relative), and the weights, fp32 masters and both Adam moments each rank holds after the load
are the saved ones, tensor by tensor."""

import glob
import os

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.tiny import tiny_config, train_losses

ITERS, SAVED = 8, 3


def _layout(tp, pp, zero, vpp=None):
    return dict(
        parallel=dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                      virtual_pipeline_model_parallel_size=vpp),
        optim=dict(zero_stage=zero, lr_decay_iters=ITERS),
    )  # fmt: skip


def _cfg(layout, **train):
    base = tiny_config(model=dict(num_layers=4, num_query_groups=2))
    return base.replace(**layout, train={"train_iters": ITERS, **train})


def _losses(cfg):
    return train_losses(cfg)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(the checkpoint directory, the uninterrupted run's losses after iteration 3)."""
    ck = str(tmp_path_factory.mktemp("reshard") / "ck")
    src = _layout(2, 1, 2)
    full = run_distributed(_losses, 4, _cfg(src))[0]
    run_distributed(_losses, 4, _cfg(src, train_iters=SAVED, save=ck, save_interval=SAVED,
                                     ckpt_format="torch_dist"))  # fmt: skip
    return ck, full[SAVED:]


TARGETS = {
    "tp1-dp4-zero1": (_layout(1, 1, 1), 4),
    "tp4-dp1-zero3": (_layout(4, 1, 3), 4),
    "pp2-dp2-zero1": (_layout(1, 2, 1), 4),
    "pp2-vpp2-dp2-zero1": (_layout(1, 2, 1, vpp=2), 4),
    "one-process-zero0": (_layout(1, 1, 0), 1),
}


@pytest.mark.parametrize("target", list(TARGETS))
def test_another_layout_continues_the_run(saved, target):
    ck, want = saved
    layout, n = TARGETS[target]
    got = run_distributed(_losses, n, _cfg(layout, load=ck))
    assert all(g == got[0] for g in got)
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(want), rtol=1e-6, atol=0.0)


def _state_after_load(cfg):
    """This rank's resharded state right after --load, as a torch_dist file would hold it."""
    from megafp8 import reshard
    from megafp8.train import build_run, init_distributed, resume

    groups, device = init_distributed(cfg)
    run = build_run(cfg, groups, device)
    assert resume(run)
    return reshard.local_state(run)


@pytest.mark.parametrize("target", ["tp4-dp1-zero3", "pp2-dp2-zero1"])
def test_moments_and_masters_survive_tensor_by_tensor(saved, target):
    from megafp8.reshard import _assemble

    ck, _ = saved
    layout, n = TARGETS[target]
    want, step, _ = _assemble(sorted(glob.glob(os.path.join(ck, "iter_0000003", "dist_*.pt"))))
    assert step == SAVED and want["embedding.weight"]["exp_avg"].abs().sum() > 0
    states = [s for s in run_distributed(_state_after_load, n, _cfg(layout, load=ck)) if s]
    seen = set()
    for st in states:
        assert st["step"] == SAVED
        for name, parts in st["params"].items():
            for e in parts:
                for k in ("fp32", "exp_avg", "exp_avg_sq"):
                    full = want[name][k]
                    mine = full if e["dim"] is None else full.index_select(e["dim"], e["index"])
                    assert torch.equal(e[k], mine), (name, k)
                seen.add(name)
    assert seen == set(want)


def test_and_back_again(saved, tmp_path):
    """(2,1,2,2) -> (4,1,1,3) for 2 iterations, saved there -> (2,1,2,2) again."""
    ck, want = saved
    ck2 = str(tmp_path / "ck2")
    mid = run_distributed(_losses, 4, _cfg(_layout(4, 1, 3), train_iters=SAVED + 2, load=ck,
                                           save=ck2, save_interval=SAVED + 2,
                                           ckpt_format="torch_dist"))[0]  # fmt: skip
    back = run_distributed(_losses, 4, _cfg(_layout(2, 1, 2), load=ck2))[0]
    torch.testing.assert_close(torch.tensor(mid + back), torch.tensor(want), rtol=1e-6, atol=0.0)


def test_a_torch_checkpoint_in_another_layout_is_one_line(tmp_path, capsys):
    from megafp8.checkpoint import check_compatible
    from megafp8.cli import parse_args
    from megafp8.train import main

    ck = str(tmp_path / "ck")
    flags = ["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads",
             "4", "--seq-length", "32", "--vocab-size", "256", "--train-iters", "2"]  # fmt: skip
    assert main([*flags, "--save", ck]) == 0
    moved = parse_args([*flags, "--pipeline-model-parallel-size", "2"])
    with pytest.raises(ValueError, match="torch_dist") as e:
        check_compatible(ck, moved)
    assert "\n" not in str(e.value) and "pipeline_model_parallel_size=1" in str(e.value)
    dist_ck = str(tmp_path / "dist")
    assert main([*flags, "--save", dist_ck, "--ckpt-format", "torch_dist"]) == 0
    check_compatible(dist_ck, moved)  # any layout loads it
    with pytest.raises(ValueError, match="num_layers"):  # but not another model
        check_compatible(dist_ck, parse_args([*flags[:1], "--num-layers", "4", *flags[3:]]))


def test_a_torch_checkpoint_converts_with_the_tool(tmp_path):
    """data_tools/convert_checkpoint.py: a --ckpt-format torch checkpoint (its own layout loads
    it, in CPU processes the tool starts) becomes torch_dist; another layout then continues."""
    import subprocess
    import sys

    ck = str(tmp_path / "ck")
    src = _layout(2, 1, 2)
    full = run_distributed(_losses, 4, _cfg(src))[0]
    run_distributed(_losses, 4, _cfg(src, train_iters=SAVED, save=ck, save_interval=SAVED))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    tool = os.path.join(root, "data_tools", "convert_checkpoint.py")
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launcher}  # not under a launcher
    env["OMP_NUM_THREADS"] = "1"
    p = subprocess.run([sys.executable, tool, "--load", ck], capture_output=True, text=True,
                       env=env, timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "torch_dist" in p.stdout
    got = run_distributed(_losses, 4, _cfg(_layout(1, 1, 1), load=ck))[0]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(full[SAVED:]), rtol=1e-6, atol=0.0)


def test_fp8_scaling_state_survives_resharding(tmp_path):
    """Delayed scaling: every amax history and scale after the load at (1, 2, 2, 1) is the one
    saved at (2, 1, 2, 2) (TP ranks hold the same, reduced, values; each stage its layers')."""
    from megafp8.reshard import _assemble

    ck = str(tmp_path / "ck")
    fp8 = dict(fp8_format="hybrid", fp8_amax_history_len=4)
    src = _cfg(_layout(2, 1, 2), train_iters=SAVED, save=ck, save_interval=SAVED,
               ckpt_format="torch_dist").replace(fp8=fp8)  # fmt: skip
    run_distributed(_losses, 4, src)
    _, _, saved = _assemble(sorted(glob.glob(os.path.join(ck, "iter_0000003", "dist_*.pt"))))
    assert saved["fp8"]
    target = _cfg(_layout(1, 2, 1), load=ck).replace(fp8=fp8)
    seen = set()
    for st in run_distributed(_state_after_load, 4, target):
        for key, meta in (st or {}).get("fp8", {}).items():
            for k, v in meta.items():
                assert torch.equal(v, saved["fp8"][key][k]), (key, k)
            seen.add(key)
    assert seen == set(saved["fp8"])


def test_expert_parallel_checkpoints_move_between_ep_sizes(tmp_path):
    """MoE: saved at EP 2 x DP 4 (each EP rank writes its experts), loaded at EP 4 and at EP 1 x
    TP 2: the uninterrupted losses."""
    moe = dict(num_layers=2, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
               moe_aux_loss_coeff=1e-2, num_query_groups=2)  # fmt: skip

    def cfg(ep, tp=1, **train):
        return tiny_config(model=moe).replace(
            parallel=dict(expert_model_parallel_size=ep, tensor_model_parallel_size=tp),
            optim=dict(lr_decay_iters=ITERS), train={"train_iters": ITERS, **train},
        )  # fmt: skip

    ck = str(tmp_path / "ck")
    full = run_distributed(_losses, 4, cfg(2))[0]
    run_distributed(_losses, 4, cfg(2, train_iters=SAVED, save=ck, save_interval=SAVED,
                                     ckpt_format="torch_dist"))  # fmt: skip
    names = os.listdir(os.path.join(ck, "iter_0000003"))
    assert {"dist_ep_00_mp_rank_00.pt", "dist_ep_01_mp_rank_00.pt"} <= set(names), names
    for ep, tp in ((4, 1), (1, 2)):
        got = run_distributed(_losses, 4, cfg(ep, tp, load=ck))[0]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(full[SAVED:]), rtol=1e-6,
                                   atol=0.0)  # fmt: skip
