"""Megatron-LM users' scripts: the flag sets of its GPT-3 175B, Llama-3 8B FP8 and Mixtral 8x7B
example launch scripts (model shrunk) go through our parser; each flag is honoured, accepted with a
one-line notice, or refused with a one-line error naming what to use instead. Megatron-style YAML
run files give the same config as the flags. The flags honoured by the loop are tested here too.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from megafp8.cli import parse_args
from megafp8.validate import validate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHRUNK = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64"  # noqa: E501

# examples/gpt3/train_gpt3_175b_distributed.sh, model shrunk (its --tensor/--pipeline sizes kept)
GPT3 = (
    SHRUNK + " --attention-backend auto --micro-batch-size 1 --global-batch-size 1536"
    " --rampup-batch-size 16 16 5859375 --train-iters 500000 --weight-decay 0.1 --adam-beta1 0.9"
    " --adam-beta2 0.95 --init-method-std 0.006 --clip-grad 1.0 --fp16 --lr 6.0e-5"
    " --lr-decay-style cosine --min-lr 6.0e-6 --lr-warmup-fraction .001 --lr-decay-iters 430000"
    " --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 --data-path D_text_document"
    " --vocab-file vocab.json --merge-file merges.txt --split 949,50,1 --log-interval 100"
    " --save-interval 10000 --eval-interval 1000 --save ck --load ck --eval-iters 10"
    " --tensorboard-dir tb"
)
# examples/llama/train_llama3_8b_h100_fp8.sh with mock data, shrunk (kv-channels = 64 / 4)
LLAMA = (
    "--use-mcore-models --num-layers 2 --hidden-size 64 --ffn-hidden-size 160"
    " --num-attention-heads 4 --group-query-attention --num-query-groups 2 --kv-channels 16"
    " --seq-length 64 --max-position-embeddings 64 --position-embedding-type rope"
    " --rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0 --hidden-dropout 0.0"
    " --swiglu --init-method-std 0.0134 --attention-backend fused --apply-layernorm-1p"
    " --untie-embeddings-and-output-weights --disable-bias-linear --micro-batch-size 1"
    " --global-batch-size 4 --train-samples 16 --lr-decay-samples 12 --lr-warmup-samples 4"
    " --lr 0.00015 --min-lr 0.00001 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5"
    " --lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9"
    " --adam-beta2 0.95 --bf16 --grad-reduce-in-bf16 --cross-entropy-loss-fusion"
    " --calculate-per-token-loss --manual-gc --empty-unused-memory-level 1"
    " --exit-duration-in-mins 235 --fp8-format hybrid --fp8-amax-history-len 1024"
    " --fp8-amax-compute-algo max --fp8-param-gather --tensor-model-parallel-size 1"
    " --context-parallel-size 1 --use-distributed-optimizer --overlap-grad-reduce"
    " --overlap-param-gather --mock-data --tokenizer-type NullTokenizer --vocab-size 256"
    " --tiktoken-pattern v2 --split 99,1,0 --no-create-attention-mask-in-dataloader"
    " --no-mmap-bin-files --num-workers 1 --log-interval 1 --eval-iters 32 --eval-interval 100"
    " --save-interval 1000 --log-throughput --profile --profile-step-start 2 --profile-step-end 3"
    " --ckpt-format torch_dist --distributed-timeout-minutes 60 --save CK --load CK"
)
# examples/mixtral/train_mixtral_8x7b_distributed.sh (its model is small already)
MIXTRAL_DENSE = (
    "--use-mcore-models --disable-bias-linear --seq-length 256 --max-position-embeddings 2048"
    " --num-layers 2 --hidden-size 256 --ffn-hidden-size 896 --num-attention-heads 2"
    " --init-method-std 0.01 --attention-dropout 0.0 --hidden-dropout 0.0 --normalization RMSNorm"
    " --position-embedding-type rope --swiglu --untie-embeddings-and-output-weights"
    " --group-query-attention --num-query-groups 2 --no-masked-softmax-fusion"
    " --no-position-embedding --rotary-base 1000000 --mock-data --split 99990,8,2"
    " --micro-batch-size 1 --global-batch-size 4 --lr 1e-4 --train-iters 7 --min-lr 1.0e-5"
    " --weight-decay 0.1 --clip-grad 1.0 --tensor-model-parallel-size 1"
    " --pipeline-model-parallel-size 1 --use-distributed-optimizer --eval-iters 10"
    " --no-load-optim --no-load-rng --overlap-param-gather --overlap-grad-reduce"
)
MIXTRAL_MOE = (
    " --num-experts 2 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss"
    " --moe-aux-loss-coeff 1e-2 --moe-token-dispatcher-type alltoall --expert-model-parallel-size 2"
)


def _parse(flags: str):
    notices: list[str] = []
    return parse_args(flags.split(), notices), notices


def test_gpt3_175b_script():
    with pytest.raises(ValueError, match=r"^--fp16: .*use --bf16"):
        _parse(GPT3)
    cfg, notices = _parse(GPT3.replace(" --fp16", " --bf16"))
    assert notices == []
    assert cfg.train.rampup_batch_size == ("16", "16", "5859375")  # 16 to 1536 in 95 steps
    assert cfg.optim.lr_warmup_iters == 430  # .001 of the 430000 decay iterations
    assert (cfg.data.vocab_file, cfg.data.merge_file) == ("vocab.json", "merges.txt")
    assert cfg.optim.adam_beta2 == 0.95 and cfg.parallel.tensor_model_parallel_size == 8
    with pytest.raises(
        ValueError, match="pipeline_model_parallel_size=16 is larger than num_layers=2"
    ):
        validate(cfg, 8 * 16)


def test_llama3_8b_fp8_script():
    cfg, notices = _parse(LLAMA)
    t, o, m = cfg.train, cfg.optim, cfg.model
    assert (t.train_iters, o.lr_decay_iters, o.lr_warmup_iters) == (4, 3, 1)  # samples / 4
    assert o.zero_stage == 1 and o.overlap_grad_reduce and o.grad_reduce_in_bf16
    assert (o.decoupled_lr, o.decoupled_min_lr) == (5.0e-4, 4.5e-5)
    assert m.apply_layernorm_1p and m.attention_backend == "fused" and m.kv_heads == 2
    assert t.calculate_per_token_loss and t.manual_gc and t.empty_unused_memory_level == 1
    assert t.exit_duration_in_mins == 235 and t.distributed_timeout_minutes == 60
    assert t.profile and (t.profile_step_start, t.profile_step_end) == (2, 3)
    assert cfg.fp8.fp8_format == "hybrid" and cfg.data.tokenizer_type == "NullTokenizer"
    assert cfg.data.tiktoken_pattern == "v2"  # TikTokenizer's flag: read, unused by Null
    noticed = sorted(n.split()[0] for n in notices)
    assert noticed == sorted(
        [
            "--use-mcore-models",
            "--fp8-param-gather",
            "--overlap-param-gather",
            "--no-create-attention-mask-in-dataloader",
            "--no-mmap-bin-files",
        ]
    )
    assert t.ckpt_format == "torch_dist"  # layout-free checkpoints (megafp8/reshard.py)
    assert all("has no effect here: " in n for n in notices)
    assert validate(cfg, 1) == 1


def test_mixtral_script():
    cfg, notices = _parse(MIXTRAL_DENSE + MIXTRAL_MOE)  # MoE flags are config fields now
    assert (cfg.model.num_experts, cfg.model.moe_router_topk) == (2, 2)
    assert cfg.model.moe_token_dispatcher_type == "alltoall"
    assert cfg.parallel.expert_model_parallel_size == 2
    assert validate(cfg, 2) == 2  # experts over the 2 data-parallel ranks
    with pytest.raises(ValueError, match="expert_model_parallel_size=2 must divide"):
        validate(cfg, 1)
    cfg, notices = _parse(MIXTRAL_DENSE)
    assert cfg.train.load_optim is False and cfg.train.load_rng is False
    assert cfg.model.normalization == "RMSNorm" and cfg.optim.zero_stage == 1
    assert [n.split()[0] for n in notices] == [
        "--use-mcore-models",
        "--overlap-param-gather",
        "--no-masked-softmax-fusion",
    ]
    assert validate(cfg, 1) == 1


@pytest.mark.parametrize(
    "flags,msg",
    [
        (
            "--mock-data --kv-channels 8",
            "--kv-channels 8 must equal hidden_size / num_attention_heads",
        ),
        ("--mock-data --rotary-percent 0.5", "only 1.0"),
        ("--mock-data --context-parallel-size 2", "context parallelism is not available"),
        ("--mock-data --no-position-embedding", "use --position-embedding-type rope"),
        ("--mock-data --train-samples 10", "needs --global-batch-size"),
        ("--mock-data --global-batch-size 4 --train-samples 10", "not a multiple of"),
    ],
)
def test_checked_flags_name_the_problem(flags, msg):
    with pytest.raises(ValueError, match=msg):
        _parse(flags)


def test_megatron_style_run_file_equals_the_flags(tmp_path):
    f = tmp_path / "llama.yaml"
    f.write_text(
        "MODEL_ARGS:\n  --num-layers: 2\n  --hidden-size: 64\n  --num-attention-heads: 4\n"
        "  --swiglu: true\n  --disable-bias-linear: true\n  --apply-layernorm-1p: false\n"
        "TRAINING_ARGS:\n  --micro-batch-size: 1\n  --global-batch-size: 4\n"
        "  --train-samples: 16\n  --use-distributed-optimizer: true\n"
        "DATA_ARGS:\n  --mock-data: true\n  --split: '99,1,0'\n  --data-path: [0.5, A, 0.5, B]\n"
        "--seq-length: 64\n"
    )
    from_file = parse_args(["--config", str(f), "--lr", "0.02"])
    flags = parse_args(
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --swiglu --disable-bias-linear"
        " --micro-batch-size 1 --global-batch-size 4 --train-samples 16"
        " --use-distributed-optimizer --mock-data --split 99,1,0 --data-path 0.5 A 0.5 B"
        " --seq-length 64 --lr 0.02".split()
    )
    assert from_file == flags
    assert from_file.train.train_iters == 4 and from_file.model.apply_layernorm_1p is False
    f.write_text("MODEL_ARGS:\n  num-layers: 2\n  --hidden-size: 64\n")
    with pytest.raises(ValueError, match="flags are written --name"):
        parse_args(["--config", str(f)])


def test_wrong_type_is_one_line_exit_2():
    p = subprocess.run(
        [sys.executable, "pretrain_gpt.py", "--mock-data", "--num-layers", "two"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip().splitlines() == [
        "error: argument --num-layers: invalid int value: 'two'"
    ]


def test_zero_centered_norm_is_the_norm_with_weight_one_plus_w():
    from megafp8.fp8.backend import Backend

    for kind in ("LayerNorm", "RMSNorm"):
        zc = Backend().make_norm(
            kind, 8, 1e-5, zero_centered_gamma=True, dtype=torch.float32, device=None
        )
        plain = Backend().make_norm(kind, 8, 1e-5, dtype=torch.float32, device=None)
        assert torch.equal(zc.weight, torch.zeros(8))  # starts as the identity scale
        with torch.no_grad():
            zc.weight.uniform_(-0.5, 0.5)
            plain.weight.copy_(1.0 + zc.weight)
        x = torch.randn(3, 8)
        torch.testing.assert_close(zc(x), plain(x), rtol=0, atol=1e-6)


def test_decoupled_lr_groups_and_deepspeed_switches():
    from megafp8.optim.zero import deepspeed_config, param_groups, set_lr
    from tests.helpers.tiny import tiny_config

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = torch.nn.Embedding(10, 4)
            self.output = torch.nn.Parameter(torch.zeros(10, 4))
            self.fc = torch.nn.Linear(4, 4)

    groups = param_groups(Net(), 0.1, decoupled=True)

    class Eng:
        class optimizer:
            param_groups = groups

    set_lr(Eng, 1e-3, 5e-4)
    got = {(g["decoupled"], g["weight_decay"], len(g["params"])): g["lr"] for g in groups}
    assert got == {(False, 0.1, 1): 1e-3, (True, 0.1, 2): 5e-4, (False, 0.0, 1): 1e-3}
    cfg = tiny_config(optim=dict(zero_stage=2, overlap_grad_reduce=True, grad_reduce_in_bf16=True))
    ds = deepspeed_config(cfg, 1)
    assert ds["zero_optimization"]["overlap_comm"] is True
    assert ds["communication_data_type"] == "bf16"
    assert "communication_data_type" not in deepspeed_config(tiny_config(), 1)  # fp32 run
    # with --bf16, Megatron's default: the gradients are reduced in fp32 (DeepSpeed's would be bf16)
    bf16 = tiny_config(train=dict(bf16=True, global_batch_size=None))
    assert deepspeed_config(bf16, 2)["communication_data_type"] == "fp32"
    assert "communication_data_type" not in deepspeed_config(bf16, 1)  # nothing to reduce
    bf16_reduce = bf16.replace(optim=dict(grad_reduce_in_bf16=True))
    assert deepspeed_config(bf16_reduce, 2)["communication_data_type"] == "bf16"


def test_llama_script_trains_end_to_end(tmp_path):
    """The Llama-3 8B FP8 flag set, shrunk, through pretrain_gpt.py on the CPU: every honoured
    flag on the path (bf16 + FP8, per-token loss, decoupled lr, manual GC, profiler window)."""
    (tmp_path / "ck").mkdir()
    flags = LLAMA.replace(" --profile-step-end 3", " --profile-step-end 4")
    flags = flags.replace(" CK", " " + str(tmp_path / "ck"))
    argv = flags.split() + ["--tensorboard-dir", str(tmp_path / "tb"), "--eval-interval", "1000"]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    p = subprocess.run(
        [sys.executable, "pretrain_gpt.py", *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count("lm loss:") == 4
    assert "notice: --fp8-param-gather has no effect here" in p.stderr
    trace = json.loads((tmp_path / "tb" / "profile_rank0.json").read_text())
    assert trace["traceEvents"]  # iterations 2 and 3 were profiled
    assert (tmp_path / "ck" / "latest").read_text() == "iter_0000004"


def test_document_reset_flags_are_taken():
    """Megatron's --reset-position-ids / --reset-attention-mask are fields here (no notice);
    the mask needs the SDPA attention, so a TE kernel named outright is refused."""
    cfg, notices = _parse("--mock-data --reset-position-ids --reset-attention-mask")
    assert cfg.data.reset_position_ids and cfg.data.reset_attention_mask and notices == []
    cfg, _ = _parse("--mock-data --reset-attention-mask --attention-backend fused")
    with pytest.raises(ValueError, match="reset_attention_mask needs attention_backend auto or "
                       "local, got fused"):  # fmt: skip
        validate(cfg, 1)


def test_fp32_gradient_accumulation_flag_is_taken():
    """Megatron's --accumulate-allreduce-grads-in-fp32 is a real switch here (no notice)."""
    cfg, notices = _parse("--mock-data --bf16 --accumulate-allreduce-grads-in-fp32")
    assert cfg.optim.accumulate_allreduce_grads_in_fp32 and notices == []


def test_precision_aware_optimizer_flag_is_taken():
    """Megatron's --use-precision-aware-optimizer is a real switch here (optim/adamw_bf16.py):
    with --bf16 and ZeRO 1/2; elsewhere one line naming the values."""
    cfg, notices = _parse("--mock-data --bf16 --use-precision-aware-optimizer")
    assert cfg.optim.use_precision_aware_optimizer and notices == []
    flags = "--main-grads-dtype bf16 --main-params-dtype fp32 --exp-avg-dtype fp32"
    cfg, notices = _parse(f"--mock-data --bf16 --use-precision-aware-optimizer {flags}")
    assert cfg.optim.use_precision_aware_optimizer and notices == []
    validate(cfg, 1)
    for extra, got in (("", "bf16=False, zero_stage=1"),
                       ("--bf16 --zero-stage 3", "bf16=True, zero_stage=3"),
                       ("--bf16 --accumulate-allreduce-grads-in-fp32",
                        "accumulate_allreduce_grads_in_fp32=True"),
                       ("--bf16 --num-experts 2", "num_experts=2")):  # fmt: skip
        cfg, _ = _parse(f"--mock-data --use-precision-aware-optimizer {extra}")
        with pytest.raises(ValueError, match=f"use_precision_aware_optimizer with .*{got}.*"
                           "it needs --bf16, ZeRO 1 or 2"):  # fmt: skip
            validate(cfg, 1)


# flags of Megatron-LM scripts in the wild beyond the example scripts above
COMMON = (
    "--mock-data --transformer-impl transformer_engine --use-flash-attn --attention-softmax-in-fp32"
    " --apply-query-key-layer-scaling --no-async-tensor-model-parallel-allreduce"
    " --use-cpu-initialization --exit-signal-handler --async-save --ckpt-fully-parallel-save"
    " --ckpt-fully-parallel-load --auto-detect-ckpt-format --log-validation-ppl-to-tensorboard"
    " --log-memory-to-tensorboard --log-timers-to-tensorboard --timing-log-level 2"
    " --timing-log-option minmax --tensorboard-log-interval 1 --log-params-norm --tp-comm-overlap"
    " --overlap-p2p-communication --ddp-bucket-size 40000000 --ddp-average-in-collective"
    " --no-persist-layer-norm --initial-loss-scale 65536 --min-loss-scale 1"
    " --loss-scale-window 1000 --hysteresis 2 --optimizer adam --dataloader-type single"
    " --use-dist-ckpt --dist-ckpt-format torch_dist --deterministic-mode --exit-interval 100"
    " --exp-avg-dtype fp32 --exp-avg-sq-dtype fp32 --override-opt_param-scheduler"
    " --exit-on-missing-checkpoint --lr-decay-style WSD --lr-wsd-decay-samples 80"
    " --global-batch-size 8 --cross-entropy-fusion-impl te --num-dataset-builder-threads 4"
    " --enable-cuda-graph --cuda-graph-impl local --use-rotary-position-embeddings"
    " --expert-tensor-parallel-size 1 --num-distributed-optimizer-instances 1"
    " --moe-router-dtype fp32 --moe-permute-fusion --moe-shared-expert-overlap"
    " --moe-per-layer-logging --keep-fp8-transpose-cache"
    " --check-weight-hash-across-dp-replicas-interval 100 --record-memory-history"
)


def test_common_script_flags_are_taken_or_noticed():
    cfg, notices = _parse(COMMON)
    t = cfg.train
    assert t.ckpt_format == "torch_dist" and t.deterministic and t.exit_interval == 100
    assert t.exit_on_missing_checkpoint and cfg.optim.lr_wsd_decay_iters == 10  # 80 / 8
    assert cfg.model.position_embedding_type == "rope"  # --use-rotary-position-embeddings
    noticed = {n.split()[0] for n in notices}
    given = {f for f in COMMON.split() if f.startswith("--")}
    taken = {"--mock-data", "--optimizer", "--dataloader-type", "--use-dist-ckpt",
             "--dist-ckpt-format", "--deterministic-mode", "--exit-interval", "--exp-avg-dtype",
             "--exp-avg-sq-dtype", "--log-params-norm", "--exit-on-missing-checkpoint",
             "--lr-decay-style", "--lr-wsd-decay-samples", "--global-batch-size",
             "--use-rotary-position-embeddings", "--expert-tensor-parallel-size",
             "--num-distributed-optimizer-instances"}  # fmt: skip
    assert noticed == given - taken
    assert all("has no effect here: " in n for n in notices)
    cfg, _ = _parse("--mock-data --use-dist-ckpt --ckpt-format torch")
    assert cfg.train.ckpt_format == "torch"  # a format given wins
    assert cfg.model.position_embedding_type == "learned_absolute"  # the default without it
    for extra in ("", " --position-embedding-type learned_absolute"):  # as Megatron: rope wins
        cfg, _ = _parse("--mock-data --use-rotary-position-embeddings" + extra)
        assert cfg.model.position_embedding_type == "rope"


@pytest.mark.parametrize(
    "flags,message",
    [
        ("--optimizer sgd", "--optimizer sgd: must be adam"),
        ("--dataloader-type cyclic", "--dataloader-type cyclic: must be single"),
        ("--exp-avg-dtype bf16", "--exp-avg-dtype bf16: must be fp32"),
        ("--main-params-dtype fp16", "--main-params-dtype fp16: must be fp32"),
        ("--main-grads-dtype fp16", "--main-grads-dtype fp16: fp32 or bf16"),
        ("--no-save-optim", "--no-save-optim: checkpoints always hold the optimizer state"),
        ("--no-save-rng", "--no-save-rng: checkpoints always hold the RNG"),
        ("--rotary-interleaved", "--rotary-interleaved: RoPE here rotates halves"),
        ("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler: the lr"),
        (
            "--use-torch-fsdp2",
            "--use-torch-fsdp2: data parallelism here is DeepSpeed ZeRO: --zero-stage 3",
        ),
        ("--use-legacy-models", "--use-legacy-models: the model here is the Megatron Core one"),
        ("--use-megatron-fsdp", "--use-megatron-fsdp: data parallelism here is DeepSpeed ZeRO"),
        (
            "--data-parallel-sharding-strategy optim_grads_params",
            "--data-parallel-sharding-strategy: data parallelism here is DeepSpeed ZeRO",
        ),
        (
            "--pipeline-model-parallel-layout Et|tL",
            "--pipeline-model-parallel-layout: stages hold equal layers: "
            "--decoder-first-pipeline-num-layers",
        ),
        (
            "--account-for-embedding-in-pipeline-split",
            "--account-for-embedding-in-pipeline-split: use --decoder-first-pipeline-num-layers",
        ),
        (
            "--account-for-loss-in-pipeline-split",
            "--account-for-loss-in-pipeline-split: use --decoder-last-pipeline-num-layers",
        ),
        ("--moe-router-topk-scaling-factor 2.5", "--moe-router-topk-scaling-factor: not available"),
        ("--moe-router-num-groups 8", "--moe-router-num-groups: group-limited routing"),
        ("--moe-router-group-topk 4", "--moe-router-group-topk: group-limited routing"),
        ("--window-size 4096,0", "--window-size: sliding-window attention is not available"),
        ("--expert-tensor-parallel-size 2", "--expert-tensor-parallel-size 2: must be 1"),
        (
            "--num-distributed-optimizer-instances 2",
            "--num-distributed-optimizer-instances 2: must be 1",
        ),
        ("--moe-router-dtype fp64", "--moe-router-dtype fp64: only fp32"),
    ],
)
def test_common_script_flags_refused_in_one_line(flags, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(")):
        _parse("--mock-data " + flags)


def _save_one_iteration(cfg):
    from tests.helpers.tiny import train_losses

    return train_losses(cfg)


def test_use_checkpoint_args_takes_the_model_from_the_checkpoint(tmp_path):
    """--use-checkpoint-args (Megatron-LM's): the sizes where no flag gives them, the rest of the
    model always, from the checkpoint --load names; the run then loads and trains on."""
    from megafp8.build import check_inputs
    from tests.helpers.dist import run_distributed
    from tests.helpers.tiny import tiny_config

    ck = str(tmp_path / "ck")
    model = dict(num_layers=3, swiglu=True, num_query_groups=2, qk_layernorm=True,
                 position_embedding_type="rope", normalization="RMSNorm", rotary_base=5e5,
                 add_bias_linear=False)  # fmt: skip
    saved = tiny_config(model=model, train=dict(train_iters=2, save=ck))
    run_distributed(_save_one_iteration, 1, saved)
    base = (f"--mock-data --load {ck} --use-checkpoint-args --micro-batch-size 2 "
            "--global-batch-size 8 --train-iters 3 --normalization LayerNorm --seed 7")  # fmt: skip
    cfg, notices = _parse(base)
    from megafp8.megatron_compat import FROM_CHECKPOINT, FROM_CHECKPOINT_IF_NOT_GIVEN

    for name in FROM_CHECKPOINT + FROM_CHECKPOINT_IF_NOT_GIVEN:  # none given but LayerNorm
        assert getattr(cfg.model, name) == getattr(saved.model, name), name
    assert len(notices) == 1 and "--use-checkpoint-args: from " in notices[0]
    assert "normalization='RMSNorm'" in notices[0] and "num_layers=3" in notices[0]
    check_inputs(cfg)  # the checkpoint's shape: compatible
    losses = run_distributed(_save_one_iteration, 1, cfg)[0]
    assert len(losses) == 1  # iteration 3, after the two saved
    cfg, _ = _parse(base + " --num-layers 5")  # a size given wins, as in Megatron-LM
    assert cfg.model.num_layers == 5 and cfg.model.qk_layernorm
    with pytest.raises(ValueError, match="num_layers=3"):
        check_inputs(cfg)  # and the checkpoint says it does not fit
    _, notices = _parse(f"--mock-data --use-checkpoint-args --load {tmp_path / 'none'}")
    assert notices == [f"--use-checkpoint-args: no checkpoint in {tmp_path / 'none'}, "
                       "the flags are used"]  # fmt: skip
    _, notices = _parse("--mock-data --use-checkpoint-args")
    assert notices == ["--use-checkpoint-args: no --load, the flags are used"]
