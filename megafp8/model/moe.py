"""Mixture of experts: a router picks k of E expert MLPs per token; the layer replaces the MLP.

Router (always fp32, never FP8): logits z = x W_r^T [T, E]. Scores: ``softmax`` or ``sigmoid``.
Top-k: with softmax, either top-k of the logits then a softmax over the k chosen (the default),
or (``moe_router_pre_softmax``) the softmax over all E then the top-k of those probabilities;
with sigmoid, the top-k of sigmoid(z) normalized to sum 1 over the k (when k > 1).

Losses (added to the backward, never to the reported lm loss): the load-balancing loss
``aux_loss`` = coeff x E / (T^2 k) x sum_e (sum_t p_te) x n_e, where p are the softmax (or
normalized sigmoid) scores over all E experts and n_e the tokens routed to e; the z-loss
coeff x mean_t (logsumexp_e z_te)^2. Their gradient is scaled as the lm loss's is (``aux_scale``
= 1 / the micro-batches of the iteration), so gradient accumulation does not change their weight.

Capacity: dropless by default. With ``moe_expert_capacity_factor`` c each expert takes at most
ceil(c T k / E) token assignments; beyond it, assignments are dropped by the lowest routing
probability (``probs``) or the latest position (``position``), and the dropped count is kept for
the metrics. ``moe_pad_expert_input_to_capacity`` runs every expert on exactly its capacity rows.

Experts: E MLPs (fc1 -> GELU or SwiGLU -> fc2, ``moe_ffn_hidden_size`` wide), each GEMM from the
backend (FP8 where the layer is), split over the expert-parallel ranks (moe_dispatch.py moves the
tokens), run in a loop over this rank's experts with tokens grouped by expert;
under FP8 each expert's row count is padded with zero rows to a multiple of 16 (the FP8 GEMM
alignment; zero rows change neither the amax nor the result). An optional shared expert (a dense
MLP of ``moe_shared_expert_intermediate_size``) sees every token and is added. Experts' weights
are initialized from seeds of their names, as every other parameter.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megafp8.model.moe_experts import FP8_ROWS, Expert, GroupedExperts, run_experts
from megafp8.parallel import mappings as M
from megafp8.parallel.layers import allreduce_grad_hook, full_normal, mark_full, param_seed
from megafp8.parallel.mappings import SOLO

__all__ = ["FP8_ROWS", "Expert", "MoELayer", "moe_metrics", "route", "update_expert_bias"]


class _AuxLossGrad(torch.autograd.Function):
    """Identity on ``out``; in backward, also d(aux)/d(...) x ``scale``, so the aux loss trains
    the router without being added to the reported loss."""

    @staticmethod
    def forward(ctx, out, aux, scale: float):
        ctx.scale, ctx.aux_shape = scale, aux.shape
        return out

    @staticmethod
    def backward(ctx, g):
        return g, torch.full(ctx.aux_shape, ctx.scale, device=g.device, dtype=torch.float32), None


def route(logits: torch.Tensor, k: int, score: str, pre_softmax: bool, bias=None):
    """logits [T, E] fp32 -> (probs [T, k], experts [T, k], scores over all E [T, E]).
    ``bias`` [E] (the aux-loss-free expert bias) moves only the choice of the k experts: the
    top-k is taken of (what is ranked + bias), the probabilities are those without it."""

    def topk(x):
        return (x if bias is None else x + bias).topk(k, dim=-1).indices

    if score == "sigmoid":
        full = torch.sigmoid(logits)
        idx = topk(full)
        probs = full.gather(1, idx)
        if k > 1:
            probs = probs / probs.sum(-1, keepdim=True)
        return probs, idx, full / full.sum(-1, keepdim=True)
    full = torch.softmax(logits, dim=-1)
    if pre_softmax:
        idx = topk(full)
        return full.gather(1, idx), idx, full
    idx = topk(logits)
    return torch.softmax(logits.gather(1, idx), dim=-1), idx, full


def aux_loss(scores: torch.Tensor, counts: torch.Tensor, k: int, coeff: float) -> torch.Tensor:
    """coeff x E / (T^2 k) x sum_e (sum_t scores_te) x counts_e."""
    return aux_loss_of_sums(scores.sum(0), counts, scores.shape[0], k, coeff)


def aux_loss_of_sums(score_sum, counts, t: int, k: int, coeff: float) -> torch.Tensor:
    """The same from the per-expert score sums [E] and counts [E] over ``t`` tokens."""
    return coeff * score_sum.shape[0] / (t * t * k) * (score_sum * counts.float()).sum()


def seq_aux_loss(scores, idx, b: int, k: int, coeff: float, group=SOLO) -> torch.Tensor:
    """The load-balancing loss of each of the ``b`` sequences (tokens [s, b] flattened
    sequence-first), averaged over them; under SP each sequence's sums run over ``group``."""
    e = scores.shape[1]
    score_sum = scores.view(-1, b, e).sum(0)  # [b, E]
    counts = F.one_hot(idx.view(-1, b, k), e).sum((0, 2))  # [b, E]
    if M.world(group) > 1:
        score_sum = M.reduce_from_tensor_parallel_region(score_sum, group)
        counts = M.all_reduce(counts.clone(), group)
    s = scores.shape[0] // b * M.world(group)
    return coeff * e / (s * s * k) * (score_sum * counts.float()).sum() / b


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    return coeff * torch.logsumexp(logits, dim=-1).square().mean()


def capacity_keep(probs, idx, e: int, cap: int, policy: str) -> torch.Tensor:
    """[T, k] bool: which assignments each expert keeps within ``cap``."""
    t, k = idx.shape
    flat_e = idx.reshape(-1)  # assignment a = token * k + slot
    if policy == "probs":
        order = torch.argsort(probs.reshape(-1), descending=True, stable=True)
    else:  # position: earlier tokens first (slot order within a token)
        order = torch.arange(t * k, device=idx.device)
    e_sorted = flat_e[order]
    onehot = F.one_hot(e_sorted, e)  # [A, E]
    rank = (onehot.cumsum(0) * onehot).sum(-1) - 1  # position within its expert's queue
    keep = torch.zeros(t * k, dtype=torch.bool, device=idx.device)
    keep[order] = rank < cap
    return keep.view(t, k)


class MoELayer(nn.Module):
    """Router + this rank's experts (+ a shared expert); x [s, b, h] -> [s, b, h].

    ``groups`` (a ParallelGroups) places it: the experts split over ``groups.ep_group`` (this
    rank holds experts [r L, (r + 1) L) of E, L = E / ep; model/moe_dispatch.py moves the
    tokens), replicated over TP (expert tensor parallelism 1); under sequence parallelism the
    layer sees this rank's sequence shard, so the router's and experts' gradients are summed
    over TP and the load-balancing statistics are those of the whole sequence."""

    def __init__(
        self, cfg, *, backend, layer: int, seed: int, fp8: bool, dtype, device, aux_scale=1.0,
        groups=None,
    ):  # fmt: skip
        super().__init__()
        from megafp8.model.moe_dispatch import make_dispatcher
        from megafp8.parallel.groups import ParallelGroups

        m = cfg.model
        groups = groups or ParallelGroups.single()
        self.e, self.k = m.num_experts, m.moe_router_topk
        self.score, self.pre = m.moe_router_score_function, m.moe_router_pre_softmax
        self.lb, self.aux_coeff = m.moe_router_load_balancing_type, m.moe_aux_loss_coeff
        self.z_coeff, self.cap_factor = m.moe_z_loss_coeff, m.moe_expert_capacity_factor
        self.drop_policy, self.pad = m.moe_token_drop_policy, m.moe_pad_expert_input_to_capacity
        self.fp8 = fp8 and backend.fp8
        self.dispatcher = make_dispatcher(m.moe_token_dispatcher_type, groups.ep_group, self.e)
        self.ep, local = self.dispatcher.ep, self.dispatcher.local
        first = groups.coords.ep * local
        self.sp_group = groups.tp_group if cfg.parallel.sequence_parallel else SOLO
        name = f"layers.{layer}.mlp"
        dev = device or "cpu"
        w = full_normal((self.e, m.hidden_size), m.init_method_std,
                        param_seed(seed, f"{name}.router"), dev, torch.float32)  # fmt: skip
        self.router = mark_full(nn.Parameter(w), f"{name}.router.weight")  # the GEMM runs in fp32
        kw = dict(backend=backend, seed=seed, fp8=fp8, dtype=dtype, device=device)
        names = [f"{name}.experts.{first + i}" for i in range(local)]  # local i: global first + i
        if m.moe_grouped_gemm and backend.grouped_gemm:  # two grouped GEMMs (TE's GroupedLinear)
            self.experts = GroupedExperts(cfg, m.moe_ffn, names=names, **kw)
        else:  # a loop of the backend's GEMMs, one pair per expert
            self.experts = nn.ModuleList(Expert(cfg, m.moe_ffn, name=n, **kw) for n in names)
        for p in self.experts.parameters():
            p.expert = True  # reduced over the expert-data-parallel group (optim/zero.py)
        self.shared = None
        if m.moe_shared_expert_intermediate_size:
            self.shared = Expert(cfg, m.moe_shared_expert_intermediate_size,
                                 name=f"{name}.shared_expert", **kw)  # fmt: skip
        for p in self.parameters():  # each TP rank saw its own tokens
            allreduce_grad_hook(p, self.sp_group)
        if m.moe_router_enable_expert_bias:  # saved with the model; the counts are not
            self.register_buffer("expert_bias", torch.zeros(self.e, device=dev))
            self.register_buffer("bias_counts", torch.zeros(self.e, device=dev), persistent=False)
        else:
            self.expert_bias = self.bias_counts = None
        self.aux_scale = aux_scale  # the lm loss's backward scale: 1 / micro-batches
        self.stats: dict[str, torch.Tensor] = {}

    def _run_experts(self, rows, counts, cap):
        """The local experts on their rows (grouped by expert), each zero-padded to its capacity
        (``moe_pad_expert_input_to_capacity``) and, under FP8, to a multiple of 16 rows."""
        wants = []
        for n in counts:
            want = cap * self.ep if (cap is not None and self.pad) else n
            if self.fp8:
                want = -(-want // FP8_ROWS) * FP8_ROWS
            # an expert without tokens runs on zero rows: its weights get a (zero) gradient
            wants.append(want if n else max(want, FP8_ROWS if self.fp8 else 1))
        return run_experts(self.experts, rows, counts, wants)

    def _losses(self, logits, full, counts, idx, b):
        """The load-balancing and z losses, over the whole sequence under SP; returns (the
        losses this rank backpropagates, their values to report)."""
        t, sp = logits.shape[0], M.world(self.sp_group)
        losses, report = {}, {}
        if self.lb == "aux_loss" and self.aux_coeff:
            score_sum = full.sum(0)
            if sp > 1:  # every rank's loss is the whole sequence's; each backprops its own rows
                score_sum = M.reduce_from_tensor_parallel_region(score_sum, self.sp_group)
                counts = M.all_reduce(counts.clone(), self.sp_group)
            losses["load_balancing_loss"] = aux_loss_of_sums(
                score_sum, counts, t * sp, self.k, self.aux_coeff
            )
            report["load_balancing_loss"] = losses["load_balancing_loss"].detach()
        if self.lb == "seq_aux_loss" and self.aux_coeff:
            loss = seq_aux_loss(full, idx, b, self.k, self.aux_coeff, self.sp_group)
            losses["load_balancing_loss"], report["load_balancing_loss"] = loss, loss.detach()
        if self.z_coeff:
            z = z_loss(logits, self.z_coeff)
            losses["z_loss"] = z / sp  # the sequence's mean is the mean of the shards' means
            report["z_loss"] = M.all_reduce(z.detach().clone(), self.sp_group) / sp
        return losses, report

    def forward(self, x):  # [s, b, h] -> [s, b, h]
        s, b, h = x.shape
        xt = x.reshape(-1, h)  # [T, h]
        logits = xt.float() @ self.router.float().t()  # [T, E], fp32 (whatever the weights' dtype)
        probs, idx, full = route(logits, self.k, self.score, self.pre, self.expert_bias)
        counts = torch.bincount(idx.reshape(-1), minlength=self.e)  # assignments per expert
        if self.expert_bias is not None and self.training and torch.is_grad_enabled():
            self.bias_counts += counts.to(self.bias_counts)  # for update_expert_bias
        keep = torch.ones_like(idx, dtype=torch.bool)
        cap = None
        if self.cap_factor is not None:
            cap = math.ceil(self.cap_factor * xt.shape[0] * self.k / self.e)
            keep = capacity_keep(probs, idx, self.e, cap, self.drop_policy)
        rows, per_expert, st = self.dispatcher.dispatch(xt, probs, idx, keep)
        y = self._run_experts(rows, per_expert, cap)
        out = self.dispatcher.combine(y, st, torch.zeros_like(xt))
        if self.shared is not None:
            out = out + self.shared(xt)
        losses, report = self._losses(logits, full, counts, idx, b)
        self.stats = {"tokens_per_expert": counts, "dropped": (~keep).sum(), **report}
        if losses and self.training and torch.is_grad_enabled():
            out = _AuxLossGrad.apply(out, sum(losses.values()), self.aux_scale)
        return out.view(s, b, h)


def update_expert_bias(model, group, rate: float) -> None:
    """After an iteration: each MoE layer's expert bias moves by ``rate`` towards balance,
    bias_e += rate x sign(mean load - load_e), the loads counted over the iteration's
    micro-batches and summed over ``group`` (every rank holding this stage: TP x DP), so
    every replica moves alike."""
    layers = [m for m in model.modules() if isinstance(m, MoELayer) and m.expert_bias is not None]
    if not layers:
        return
    counts = M.all_reduce(torch.stack([m.bias_counts for m in layers]), group)
    for m, c in zip(layers, counts, strict=True):
        m.expert_bias += rate * torch.sign(c.mean() - c)
        m.bias_counts.zero_()


def moe_metrics(model) -> dict[str, float]:
    """The last forward's router statistics of every MoE layer of ``model``: per layer the load
    imbalance (max / mean tokens per expert), the dropped assignments and the aux losses; and
    their sums over layers ("moe/load_balancing_loss", "moe/z_loss")."""
    out: dict[str, float] = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, MoELayer) or not mod.stats:
            continue
        st = mod.stats
        c = st["tokens_per_expert"].float()
        out[f"moe/{name}/load_imbalance"] = float(c.max() / c.mean().clamp(min=1e-9))
        out[f"moe/{name}/dropped"] = float(st["dropped"])
        for k in ("load_balancing_loss", "z_loss"):
            if k in st:
                out[f"moe/{name}/{k}"] = float(st[k])
                out[f"moe/{k}"] = out.get(f"moe/{k}", 0.0) + float(st[k])
    return out
