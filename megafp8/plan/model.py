"""The planner's model of one training step: memory per GPU and time per iteration.

Memory (bytes per GPU, the most loaded pipeline stage), DeepSpeed ZeRO with bf16 parameters:
- weights 2 B/param (fp32 runs: 4), gradients 2 B/param (ZeRO-2/3: / dp), fp32 master weights
  4 and Adam moments 8 B/param (/ dp from ZeRO-1 on); in the optimizer step a fp32 copy of one
  optimizer group's gradient partition (4 B/param of the group / dp; the groups are bounded by
  ``--optimizer-group-max-numel``, 0: one group of every weight) joins them. ZeRO-3 keeps 2/dp
  B/param of weights plus one gathered layer.
- the te backend's FP8 weight cache: two FP8 copies (row- and column-wise) of every GEMM weight
  shard, 2 B/param of the decoder layers.
- activations of one micro-batch per layer (bf16, flash attention: no s x s matrix), summed from
  what the layers keep for the backward: 2 s b h for each of the block input, both norm outputs,
  the attention output and the MLP output; 2 s b (q + k + v widths) for q, k, v; 2 s b x the fc1
  output width and 2 s b ffn for the activation; under TP the sharded parts divide by tp, and with
  sequence parallelism the rest too. FP8 GEMMs keep their inputs in FP8 (1 byte) instead.
  Recompute: full keeps 2 s b h per layer (/tp under SP) plus one layer's working set; selective
  drops the core attention's output. 1F1B: the first stage holds min(pp, m) micro-batches in
  flight (interleaved: x (1 + (pp - 1) / (pp v))).
- the logits of one micro-batch on the last stage, 2 s b V / tp (the fused loss writes its
  gradient in place), and a fixed 2 GiB of workspace (cuBLAS, TE, NCCL buffers).
The peak is the larger of the backward's (all of the above) and the optimizer step's (states and
the fp32 gradient partition, no activations).

Time: decoder GEMMs, attention and the output layer at efficiencies fitted to this project's
single-H200 measurements (BENCHMARKS.md: 1.3B, 7B shape, Llama-3-8B shape, BF16 and FP8; all six
within 8 %), the optimizer step at a measured cost per parameter, plus communication at stated
bandwidths that is not overlapped: TP (SP: 4 all-gathers / reduce-scatters of s b h per layer
forward and 4 backward; without SP 4 all-reduces of twice the bytes), the DP gradient reduction
(2 bytes per parameter of the stage, twice (reduce-scatter + all-gather), x (dp-1)/dp), and the
pipeline bubble (pp - 1) / (v m) of the compute. Expert parallelism (ep inside DP, expert TP 1):
each GPU holds num_experts / ep routed experts of every MoE layer (whole on every TP rank); their
ZeRO states shard over the dp / ep replicas and their gradients reduce over those only; the
tokens move in 4 all-to-alls per MoE layer and micro-batch (dispatch and combine, forward and
backward) of s b k h bf16 x (ep - 1) / ep, over NVLink while tp x ep GPUs fit in a node, else the
network, not overlapped. Multi-GPU and multi-node figures are this model's, not measurements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GiB = 2**30


@dataclass(frozen=True)
class Gpu:
    name: str
    mem_gib: float  # usable memory
    bf16_tflops: float  # dense peak
    fp8_tflops: float
    nvlink_gbs: float  # effective per-GPU bus bandwidth inside a node (collectives)
    net_gbs: float  # effective per-GPU bandwidth between nodes


GPUS = {
    "h100": Gpu("h100", 79.1, 989.0, 1979.0, 360.0, 45.0),
    "h200": Gpu("h200", 139.8, 989.0, 1979.0, 360.0, 45.0),
    "b200": Gpu("b200", 178.0, 2250.0, 4500.0, 720.0, 45.0),
}
# fitted to the six single-H200 runs of BENCHMARKS.md (tests/unit/test_plan.py checks them)
EFF_GEMM = {"bf16": 0.61, "fp8": 0.46}  # share of the precision's dense peak
EFF_ATTN = 0.32  # flash attention, of the BF16 peak (FLOPs counted causal)
STEP_S_PER_PARAM = 2.67e-11  # DeepSpeed's optimizer step, measured 121 ms for 4.54 B parameters
WORKSPACE_GIB = 2.0


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    vpp: int = 1
    zero: int = 1
    micro: int = 1
    recompute: str | None = None  # None | "selective" | "full"
    sp: bool = False
    ep: int = 1  # expert parallelism, inside DP: the routed experts split over ep GPUs

    @property
    def edp(self) -> int:
        """The expert-data-parallel size: the replicas of each routed expert."""
        return self.dp // self.ep

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp


def layer_params(m) -> tuple[float, float]:
    """(GEMM weights, other parameters) of one decoder layer, whole (not sharded)."""
    h = m.hidden_size
    qkv = h * (m.num_attention_heads + 2 * m.kv_heads) * m.head_dim
    proj = m.num_attention_heads * m.head_dim * h
    if m.num_experts:
        ffn = m.moe_ffn
        mlp = m.num_experts * (3 if m.swiglu else 2) * h * ffn + m.num_experts * h
        mlp += (3 if m.swiglu else 2) * h * (m.moe_shared_expert_intermediate_size or 0)
    else:
        mlp = (3 if m.swiglu else 2) * h * m.ffn
    other = 4 * h if m.normalization == "LayerNorm" else 2 * h
    if m.add_bias_linear:
        other += qkv / h + h + (2 * m.ffn if m.swiglu else m.ffn) + h
    elif m.add_qkv_bias:
        other += qkv / h
    if m.qk_layernorm:  # a q and a k norm over the head dim
        other += (4 if m.normalization == "LayerNorm" else 2) * m.head_dim
    return qkv + proj + mlp, other


def expert_params(m) -> float:
    """The routed experts' weights of one layer (whole): split over EP, replicated over TP."""
    if not m.num_experts:
        return 0.0
    return m.num_experts * (3 if m.swiglu else 2) * m.hidden_size * m.moe_ffn


def active_gemm_params(m) -> float:
    """GEMM weights one token goes through in a layer (MoE: k experts and the shared one)."""
    gemm, _ = layer_params(m)
    if m.num_experts:
        per = (3 if m.swiglu else 2) * m.hidden_size * m.moe_ffn
        gemm -= per * (m.num_experts - m.moe_router_topk) + m.num_experts * m.hidden_size
    return gemm


def stage_params(m, padded_vocab: int, lay: Layout) -> float:
    """Parameters held by one GPU of the most loaded stage (the first, or the last)."""
    dense, experts = stage_split(m, padded_vocab, lay)
    return dense + experts


def stage_split(m, padded_vocab: int, lay: Layout) -> tuple[float, float]:
    """(dense parameters, routed-expert parameters) on one GPU of the most loaded stage: the
    dense GEMMs split over TP, the experts over EP (expert TP is 1: whole on every TP rank)."""
    gemm, other = layer_params(m)
    exp = expert_params(m)
    layers = math.ceil(m.num_layers / lay.pp)
    emb = padded_vocab * m.hidden_size / lay.tp
    pos = m.max_positions * m.hidden_size if m.position_embedding_type != "rope" else 0
    ends = emb + pos if lay.pp > 1 else emb * (2 if m.untie_embeddings_and_output_weights else 1)
    moe_layers = _moe_layers(m, layers)
    dense_mlp = (3 if m.swiglu else 2) * m.hidden_size * m.ffn  # the MLP of a layer without MoE
    dense = layers * ((gemm - exp) / lay.tp + other) + (layers - moe_layers) * (
        dense_mlp / lay.tp if m.num_experts else 0.0
    )
    return dense + ends, moe_layers * exp / lay.ep


def _moe_layers(m, layers: int) -> int:
    """MoE layers among ``layers`` of a stage, at the model's share (``--moe-layer-freq``)."""
    if not m.num_experts:
        return 0
    return math.ceil(layers * sum(map(m.is_moe_layer, range(m.num_layers))) / m.num_layers)


def activation_bytes_per_layer(m, s: int, b: int, lay: Layout, fp8: bool) -> float:
    """What one layer keeps for the backward of one micro-batch."""
    h, t = m.hidden_size, lay.tp
    rep = 1.0 / t if lay.sp else 1.0  # the replicated residual stream, split under SP
    sbh = s * b * h
    if lay.recompute == "full":
        return 2 * sbh * rep
    gemm_in = 1 if fp8 else 2  # TE keeps FP8 GEMM inputs for the weight gradient
    width = (m.num_attention_heads + 2 * m.kv_heads) * m.head_dim
    ffn = m.moe_ffn * m.moe_router_topk if m.num_experts else m.ffn
    fc1_out = 2 * ffn if m.swiglu else ffn
    keep = 2 * sbh * rep * 3  # block input, residual after attention, norm statistics etc.
    keep += gemm_in * sbh * rep * 2  # the two norm outputs (QKV and fc1 inputs)
    keep += 2 * s * b * width / t  # q, k, v
    keep += 0 if lay.recompute == "selective" else 2 * sbh / t  # core attention output
    keep += gemm_in * sbh / t  # proj input
    keep += 2 * s * b * fc1_out / t + gemm_in * s * b * ffn / t  # fc1 output, fc2 input
    return keep


def memory_gib(m, padded_vocab: int, lay: Layout, fp8: bool, bf16: bool, m_batches: int,
               group_numel: int = 0) -> dict:  # fmt: skip
    """Per-GPU memory in GiB by part, and the peak. ``group_numel``: the optimizer groups' bound
    (``--optimizer-group-max-numel``; 0: one group for all weights)."""
    dense, exp = stage_split(m, padded_vocab, lay)
    p = dense + exp
    d = lay.dp
    shard = dense / d + exp / lay.edp  # ZeRO: dense states over DP, experts' over expert-DP
    wbytes = 2 if bf16 else 4
    weights = wbytes * (shard if lay.zero == 3 else p)
    grads = (2 if bf16 else 4) * (shard if lay.zero >= 2 else p)
    master = 4 * shard if bf16 else 0.0
    moments = 8 * (shard if lay.zero >= 1 else p)
    # the step's fp32 gradient copy covers one optimizer group at a time: the bound, or the
    # largest tensor (the vocab-sized embedding or output layer shard) where that is larger
    group = (
        p if group_numel <= 0 else min(p, max(group_numel, padded_vocab * m.hidden_size / lay.tp))
    )
    step_grads = group * 4 / (d if lay.zero >= 1 else 1) if bf16 else 0.0
    gemm, other = layer_params(m)
    layers = math.ceil(m.num_layers / lay.pp)
    moe_layers = _moe_layers(m, layers)
    gemm_here = layers * (gemm - expert_params(m)) / lay.tp + moe_layers * expert_params(m) / lay.ep
    cache = 2 * gemm_here if fp8 else 0.0  # FP8 copies of this GPU's GEMM weights
    s, b = m.seq_length, lay.micro
    act = activation_bytes_per_layer(m, s, b, lay, fp8) * layers
    if lay.recompute == "full":  # plus one layer's working set during its recomputation
        full = Layout(lay.tp, lay.pp, lay.dp, sp=lay.sp, micro=lay.micro, ep=lay.ep)
        act += activation_bytes_per_layer(m, s, b, full, fp8)
    if lay.pp > 1:  # the first stage's micro-batches in flight
        inter = 1 + (lay.pp - 1) / (lay.pp * lay.vpp) if lay.vpp > 1 else 1
        act *= min(lay.pp, m_batches) * inter
    logits = 2 * s * b * padded_vocab / lay.tp
    states = weights + grads + master + moments + cache
    parts = {
        "weights": weights, "gradients": grads, "master weights": master, "Adam moments": moments,
        "FP8 weight cache": cache, "activations": act, "logits": logits,
        "optimizer-step gradients": step_grads,
    }  # fmt: skip
    out = {k: v / GiB for k, v in parts.items()}
    backward = states + act + logits
    step = states + step_grads
    out["peak"] = max(backward, step) / GiB + WORKSPACE_GIB
    out["peak at"] = "backward" if backward >= step else "optimizer step"
    return out


def step_seconds(m, padded_vocab: int, lay: Layout, gpu: Gpu, fp8: bool, gbs: int,
                 nodes: int) -> dict:  # fmt: skip
    """Seconds per iteration by part (model FLOPs counted once, divided over the GPUs)."""
    s, h, L = m.seq_length, m.hidden_size, m.num_layers
    tokens = gbs * s
    gemm_w = active_gemm_params(m)
    n = lay.gpus
    prec = "fp8" if fp8 else "bf16"
    peak = gpu.fp8_tflops if fp8 else gpu.bf16_tflops
    t_gemm = 6 * tokens * L * gemm_w / (EFF_GEMM[prec] * peak * 1e12) / n
    t_attn = 6 * tokens * L * s * h / (EFF_ATTN * gpu.bf16_tflops * 1e12) / n
    t_out = 6 * tokens * h * padded_vocab / (EFF_GEMM["bf16"] * gpu.bf16_tflops * 1e12) / n
    compute = t_gemm + t_attn + t_out
    m_batches = gbs // (lay.micro * lay.dp)
    bubble = compute * (lay.pp - 1) / (lay.vpp * m_batches) if lay.pp > 1 else 0.0
    recompute = {"full": t_gemm / 3 + t_attn / 3, "selective": t_attn / 3}.get(lay.recompute, 0.0)
    tp_bytes = 0.0
    if lay.tp > 1:  # per layer per micro-batch: 8 collectives of s b h bf16 (x2 without SP)
        tp_bytes = 8 * 2 * s * lay.micro * h * (lay.tp - 1) / lay.tp * (1 if lay.sp else 2)
        tp_bytes *= math.ceil(L / lay.pp) * m_batches
    t_tp = tp_bytes / (gpu.nvlink_gbs * 1e9)
    dense, exp = stage_split(m, padded_vocab, lay)
    dp_bw = gpu.net_gbs if nodes > 1 and lay.dp > 1 else gpu.nvlink_gbs
    d, e = lay.dp, lay.edp  # experts' gradients are reduced over their replicas only
    reduced = dense * (d - 1) / d + (exp * (e - 1) / e if e > 1 else 0.0)
    t_dp = 2 * 2 * reduced / (dp_bw * 1e9) if lay.dp > 1 else 0.0
    t_step = (dense / d + exp / e if lay.zero >= 1 else dense + exp) * STEP_S_PER_PARAM
    t_ep = 0.0
    if lay.ep > 1 and m.num_experts:  # dispatch and combine, forward and backward, per MoE layer
        per_node = max(1, lay.gpus // max(1, nodes))
        ep_bw = gpu.nvlink_gbs if lay.tp * lay.ep <= per_node else gpu.net_gbs
        moe_layers = _moe_layers(m, math.ceil(L / lay.pp))
        sent = 4 * 2 * s * lay.micro * m.moe_router_topk * h * (lay.ep - 1) / lay.ep
        t_ep = sent * moe_layers * m_batches / (ep_bw * 1e9)
    total = compute + recompute + bubble + t_tp + t_dp + t_ep + t_step
    return {"compute": compute, "recompute": recompute, "bubble": bubble, "tp comm": t_tp,
            "dp comm": t_dp, "ep comm": t_ep, "optimizer step": t_step,
            "total": total}  # fmt: skip
