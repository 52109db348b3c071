"""Per-layer tensor-parallel equivalence at TP 2 and 4, sequence parallelism on and off.

Each rank builds the TP layer and the single-process layer (``tp_group=SOLO``) from the same name
and seed, and compares forward output, input gradient and this rank's weight/bias-gradient shard
(found through the ``full_name``/``full_index``/``partition_dim`` marks) with the single-process
numbers; likewise each autograd mapping of ``megafp8.parallel.mappings`` against the collective it
claims, computed locally from every rank's inputs (each rank can regenerate all of them).

Two kinds of data:

- "grid" values make fp32 arithmetic exact, so every comparison is bit-exact (``torch.equal``),
  cross-rank sums included, on any CPU: inputs and output gradients are k/4 with |k| <= 4,
  weights are rounded to multiples of 2^-6 and clamped to [-2, 2], biases are k/256. Every
  product is then a multiple of 2^-8 (x*w, g*w) or 2^-4 (g*x), and every partial sum of at most
  24 such terms (+ a bias) is below 64 in magnitude, i.e. below 2^(24-8) units of 2^-8: each sum
  is exactly representable, so its value does not depend on summation order or on how the sum is
  split across ranks. FP8 (torch backend, emulated GEMM, delayed recipe on its first step, where
  every scale is 1): x and g (k/4, |k| <= 4) are exact in E4M3/E5M2, quantized weights are
  multiples of 2^-9 below 2, so products are multiples of 2^-11 and sums stay below 2^13 units:
  exact again, and the FP8 layer must equal the single-process FP8 layer bit for bit (which in
  turn must equal the fp32 layer with its weight rounded to E4M3, so a wrong FP8 GEMM shared
  by both does not pass unseen).
- "gaussian" values (the layers' own N(0, 0.5^2) init, normal inputs) are checked against a float64
  reference with Higham's bound: any fp32 evaluation of a length-n dot product (any order, any
  split into per-rank partials summed later, with or without FMA) errs by at most
  gamma_n * sum|a_i b_i|, gamma_n = n u / (1 - n u), u = 2^-24. That bound holds for the
  single-process and the TP layer alike; a wrong shard or a missing/extra reduction is O(1).
"""

import functools

import pytest
import torch

from megafp8.parallel.mappings import SOLO
from tests.helpers.dist import run_distributed

U = 2.0**-24
S, B, IN, OUT = 8, 2, 16, 24  # seq, batch, in/out features (S, IN, OUT divisible by 2 and 4)
VOCAB, HID = 32, 8


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def grid(shape, seed, bits=2, hi=4):
    """Integers in [-hi, hi] times 2^-bits."""
    return torch.randint(-hi, hi + 1, shape, generator=_gen(seed)).float() / 2**bits


def gauss(shape, seed):
    return torch.randn(shape, generator=_gen(seed))


class Checks:
    """Collects failures (so one run reports them all) and counts the comparisons made."""

    def __init__(self):
        self.fails, self.count = [], 0

    def equal(self, name, got, want):
        self.count += 1
        if got is None or got.shape != want.shape or not torch.equal(got, want):
            d = (
                (got - want).abs().max().item()
                if got is not None and got.shape == want.shape
                else "-"
            )
            self.fails.append(f"{name}: not bit-equal (max |diff| {d})")

    def within(self, name, got, want64, bound):
        self.count += 1
        if got is None or got.shape != want64.shape:
            self.fails.append(f"{name}: missing or wrong shape")
            return
        excess = ((got.double() - want64).abs() / bound).max().item()
        if not excess <= 1.0:
            self.fails.append(f"{name}: error is {excess:.3g} x the fp32 bound")


def _backend(fp8, group):
    from megafp8.fp8.backend import Backend
    from megafp8.fp8.recipe import Fp8Recipe
    from megafp8.fp8.torch_backend import TorchBackend

    if not fp8:
        return Backend()
    recipe = Fp8Recipe("hybrid", "delayed", 0, 4, "max")
    return TorchBackend(recipe, amax_group=group, gemm="emulated")


def _layer(kind, group, sp, fp8):
    from megafp8.parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megafp8.parallel.mappings import SOLO

    if kind == "column":
        cls = functools.partial(ColumnParallelLinear, weight_grad_group=SOLO)
    else:
        cls = RowParallelLinear
    return cls(
        IN,
        OUT,
        backend=_backend(fp8, group),
        name=f"{kind}.layer",
        tp_group=group,
        std=0.5,
        seed=11,
        sequence_parallel=sp,
    )


def _shard(p, full):
    """The slice of a single-process tensor that the TP parameter ``p`` holds."""
    return full.index_select(p.partition_dim, p.full_index) if hasattr(p, "full_index") else full


def _pairs(par, ref):
    refs = {p.full_name: p for p in ref.parameters()}
    return [(n, p, refs[p.full_name]) for n, p in par.named_parameters()]


def _run_linear(kind, par, ref, x_full, g_full, tp, r, sp):
    """Forward/backward both layers; return (par out, par dx, ref out, ref dx) with the ref
    numbers already cut to what this rank holds."""
    cols = par.weight.full_index if kind == "row" else None
    x_ref = x_full.clone().requires_grad_()
    y_ref = ref(x_ref)
    y_ref.backward(g_full)
    if kind == "column":
        rows = par.weight.full_index
        x_in = x_full.chunk(tp, 0)[r] if sp else x_full
        want_y, g_par = y_ref[..., rows], g_full[..., rows]
        want_dx = x_ref.grad.chunk(tp, 0)[r] if sp else x_ref.grad
    else:
        x_in = x_full[..., cols]
        want_y = y_ref.chunk(tp, 0)[r] if sp else y_ref
        g_par = g_full.chunk(tp, 0)[r] if sp else g_full
        want_dx = x_ref.grad[..., cols]
    x_par = x_in.clone().requires_grad_()
    y = par(x_par)
    y.backward(g_par)
    return y.detach(), x_par.grad, want_y.detach(), want_dx


def check_linear_grid(c, kind, group, tp, r, sp, fp8):
    tag = f"{kind} sp={sp} fp8={fp8} grid"
    par, ref = _layer(kind, group, sp, fp8), _layer(kind, SOLO, False, fp8)
    with torch.no_grad():
        for n, p, q in _pairs(par, ref):  # the shard is the full init's slice, bit for bit
            c.equal(f"{tag} init {n}", p, _shard(p, q))
            if q.ndim == 2:
                q.copy_((q * 64).round().div(64).clamp(-2, 2))
            else:
                q.copy_(grid(q.shape, 5, bits=8, hi=8))
            p.copy_(_shard(p, q))
    x, g = grid((S, B, IN), 1), grid((S, B, OUT), 2)
    y, dx, want_y, want_dx = _run_linear(kind, par, ref, x, g, tp, r, sp)
    c.equal(f"{tag} output", y, want_y)
    c.equal(f"{tag} input grad", dx, want_dx)
    for n, p, q in _pairs(par, ref):
        c.equal(f"{tag} grad {n}", p.grad, _shard(p, q.grad))
    if fp8:  # anchor the FP8 reference itself: with every scale 1 and x, g exact in E4M3/E5M2,
        # the layer is the fp32 layer with its weight rounded to E4M3, bit for bit
        ref.zero_grad()
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        y1 = ref(x1)
        y1.backward(g)
        w = ref.weight.detach().to(torch.float8_e4m3fn).float().requires_grad_()
        bias = next(q for _, _, q in _pairs(par, ref) if q.ndim == 1).detach().requires_grad_()
        y2 = torch.nn.functional.linear(x2, w, bias)
        y2.backward(g)
        c.equal(f"{tag} reference output = e4m3(W) GEMM", y1.detach(), y2.detach())
        c.equal(f"{tag} reference input grad", x1.grad, x2.grad)
        c.equal(f"{tag} reference weight grad", ref.weight.grad, w.grad)


def check_linear_gauss(c, kind, group, tp, r, sp):
    tag = f"{kind} sp={sp} gaussian"
    par, ref = _layer(kind, group, sp, False), _layer(kind, SOLO, False, False)
    with torch.no_grad():  # non-zero biases, so their gradients and the bias add are exercised
        for _, p, q in _pairs(par, ref):
            if q.ndim == 1:
                q.copy_(gauss(q.shape, 6))
                p.copy_(_shard(p, q))
    x, g = gauss((S, B, IN), 3), gauss((S, B, OUT), 4)
    y, dx, _, _ = _run_linear(kind, par, ref, x, g, tp, r, sp)
    w = ref.weight.detach().double()
    bias = next(q for _, _, q in _pairs(par, ref) if q.ndim == 1).detach().double()
    x64, g64, M = x.double(), g.double(), S * B
    # float64 references and their fp32 bounds (length of each dot product + 1 for the bias)
    y64 = x64 @ w.t() + bias
    y_bound = gamma(IN + 1) * (x64.abs() @ w.abs().t() + bias.abs())
    dx64, dx_bound = g64 @ w, gamma(OUT) * (g64.abs() @ w.abs())
    g2, x2 = g64.reshape(M, OUT), x64.reshape(M, IN)
    dw64, dw_bound = g2.t() @ x2, gamma(M) * (g2.abs().t() @ x2.abs())
    db64, db_bound = g2.sum(0), gamma(M) * g2.abs().sum(0)
    if kind == "column":
        rows = par.weight.full_index
        cut_y = lambda t: t[..., rows]
        cut_dx = (lambda t: t.chunk(tp, 0)[r]) if sp else (lambda t: t)
    else:
        cols = par.weight.full_index
        cut_y = (lambda t: t.chunk(tp, 0)[r]) if sp else (lambda t: t)
        cut_dx = lambda t: t[..., cols]
    c.within(f"{tag} output", y, cut_y(y64), cut_y(y_bound))
    c.within(f"{tag} input grad", dx, cut_dx(dx64), cut_dx(dx_bound))
    for n, p, _ in _pairs(par, ref):
        want, bound = (dw64, dw_bound) if p.ndim == 2 else (db64, db_bound)
        c.within(f"{tag} grad {n}", p.grad, _shard(p, want), _shard(p, bound))
    # the bound is about fp32 itself: the single-process layer must meet it too
    c.within(f"{tag} reference output", ref(x).detach(), y64, y_bound)


def check_embedding(c, group, tp, r):
    from megafp8.parallel.layers import VocabParallelEmbedding

    kw = dict(name="embedding", std=0.5, seed=13)
    par = VocabParallelEmbedding(VOCAB, HID, tp_group=group, **kw)
    ref = VocabParallelEmbedding(VOCAB, HID, tp_group=SOLO, **kw)
    c.equal("embedding init", par.weight.detach(), _shard(par.weight, ref.weight).detach())
    tokens = torch.randint(0, VOCAB, (S, B), generator=_gen(7))
    g = grid((S, B, HID), 8)
    y, y_ref = par(tokens), ref(tokens)
    y.backward(g)
    y_ref.backward(g)
    # one rank contributes the row, the others exact zeros: the all-reduce is exact
    c.equal("embedding output", y.detach(), y_ref.detach())
    c.equal("embedding grad", par.weight.grad, _shard(par.weight, ref.weight.grad))


def check_cross_entropy(c, group, tp, r):
    from megafp8.parallel.layers import vocab_parallel_cross_entropy as vpce

    z = 3.0 * gauss((S, B, VOCAB), 9)
    target = torch.randint(0, VOCAB, (S, B), generator=_gen(10))
    zp = z.chunk(tp, -1)[r].clone().requires_grad_()
    zr = z.clone().requires_grad_()
    loss, loss_ref = vpce(zp, target, group), vpce(zr, target, SOLO)
    loss.sum().backward()
    loss_ref.sum().backward()
    z64 = z.double()
    lse = torch.logsumexp(z64, -1)
    loss64 = lse - z64.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    p64 = torch.softmax(z64, -1)
    grad64 = p64 - torch.nn.functional.one_hot(target, VOCAB).double()
    # fp32 error of loss = log(sum_v exp(z_v - m)) - (z_t - m), m = max (exact):
    #   z - m rounds by u|z - m|, so exp(z - m) by u|z - m| + 2u (exp within 1 ulp);
    #   the sum of V positive terms adds gamma_(V-1) relative (any order, any split across
    #   ranks); log turns the relative error of the sum into an absolute one, plus 2u|lse - m|;
    #   the final subtraction adds u|loss|. Doubled to cover second-order terms and exp
    #   implementations up to 2 ulp.
    spread = (z64.amax(-1) - z64.amin(-1)).unsqueeze(-1)
    m = z64.amax(-1)
    rel = 2 * ((VOCAB + 2) * U + 2 * U * spread.squeeze(-1))
    loss_bound = rel + 2 * (2 * U * (lse - m).abs() + U * loss64.abs())
    c.within("cross-entropy loss", loss, loss64, loss_bound)
    c.within("cross-entropy reference loss", loss_ref, loss64, loss_bound)
    # softmax = e_v / sum: relative error of e_v (u|z - m| + 2u) plus that of the sum plus the
    # division (u); the -1 of the target's entry rounds by at most u. Doubled as above.
    grad_bound = 2 * ((VOCAB + 4) * U + 2 * U * spread) * p64 + 2 * U
    cut = lambda t: t.chunk(tp, -1)[r]
    c.within("cross-entropy logits grad", zp.grad, cut(grad64), cut(grad_bound))
    c.within("cross-entropy reference grad", zr.grad, grad64, grad_bound)


def check_mappings(c, group, tp, r):
    from megafp8.parallel import mappings as M

    shape = (S, B, 8)
    # every rank's input and output gradient, regenerated on each rank from the rank's seed
    xs = [grid(shape, 100 + q) for q in range(tp)]
    gs = [grid(shape, 200 + q) for q in range(tp)]
    g_narrow = [g[..., : 8 // tp] for g in gs]  # gradients of [S, B, 8/tp] outputs
    g_short = [g[: S // tp] for g in gs]  # gradients of [S/tp, B, 8] outputs
    g_wide = [grid((S, B, 8 * tp), 300 + q) for q in range(tp)]  # of [S, B, 8 tp] outputs
    x_rep = xs[0]  # a tensor replicated on every rank
    last = lambda t: t.chunk(tp, -1)[r]
    first = lambda t: t.chunk(tp, 0)[r]
    sum_x, sum_g = sum(xs), sum(gs)  # exact: grid values
    cases = {
        # name: (function, input, output gradient, expected output, expected input gradient)
        "copy_to_tp": (M.copy_to_tensor_parallel_region, x_rep, gs[r], x_rep, sum_g),
        "reduce_from_tp": (M.reduce_from_tensor_parallel_region, xs[r], gs[0], sum_x, gs[0]),
        "scatter_to_tp": (
            M.scatter_to_tensor_parallel_region,
            x_rep,
            g_narrow[r],
            last(x_rep),
            torch.cat(g_narrow, -1),
        ),
        "gather_from_tp": (
            M.gather_from_tensor_parallel_region,
            xs[r],
            g_wide[r],
            torch.cat(xs, -1),
            last(g_wide[r]),
        ),
        "scatter_to_sp": (
            M.scatter_to_sequence_parallel_region,
            x_rep,
            g_short[r],
            first(x_rep),
            torch.cat(g_short, 0),
        ),
        "reduce_scatter_to_sp": (
            M.reduce_scatter_to_sequence_parallel_region,
            xs[r],
            g_short[r],
            first(sum_x),
            torch.cat(g_short, 0),
        ),
    }
    # gather along the sequence: backward reduce-scatters when the gathered tensor fed TP-split
    # compute (each rank holds a partial gradient), else keeps this rank's chunk
    for tp_grad, want_dx in ((True, first(sum_g)), (False, first(gs[r]))):
        cases[f"gather_from_sp(tp_grad={tp_grad})"] = (
            lambda x, grp, t=tp_grad: M.gather_from_sequence_parallel_region(x, grp, t),
            first(xs[r]),
            gs[r],
            torch.cat([xq.chunk(tp, 0)[q] for q, xq in enumerate(xs)], 0),
            want_dx,
        )
    for name, (fn, x, g, want_y, want_dx) in cases.items():
        x = x.clone().requires_grad_()
        y = fn(x, group)
        y.backward(g)
        c.equal(f"{name} forward", y.detach(), want_y)
        c.equal(f"{name} backward", x.grad, want_dx)
    c.count += 1
    try:
        M.scatter_to_sequence_parallel_region(torch.zeros(tp + 1, 2), group)
        c.fails.append("scatter_to_sp accepted a sequence the group does not divide")
    except ValueError:
        pass


def _all_checks(tp):
    import torch.distributed as dist

    torch.manual_seed(0)
    group, r = dist.group.WORLD, dist.get_rank()
    sections = {}
    for name, fn in [
        ("mappings", lambda c: check_mappings(c, group, tp, r)),
        ("embedding", lambda c: check_embedding(c, group, tp, r)),
        ("cross_entropy", lambda c: check_cross_entropy(c, group, tp, r)),
        *[
            (
                f"{kind}_grid",
                lambda c, k=kind: [
                    check_linear_grid(c, k, group, tp, r, sp, fp8)
                    for sp in (False, True)
                    for fp8 in (False, True)
                ],
            )
            for kind in ("column", "row")
        ],
        *[
            (
                f"{kind}_gauss",
                lambda c, k=kind: [
                    check_linear_gauss(c, k, group, tp, r, sp) for sp in (False, True)
                ],
            )
            for kind in ("column", "row")
        ],
    ]:
        c = Checks()
        fn(c)
        sections[name] = (c.count, c.fails)
    return sections


@pytest.fixture(scope="module", params=[2, 4], ids=lambda tp: f"tp{tp}")
def results(request):
    tp = request.param
    return tp, run_distributed(_all_checks, tp, tp)


SECTIONS = ["mappings", "embedding", "cross_entropy"] + [
    f"{k}_{m}" for k in ("column", "row") for m in ("grid", "gauss")
]


@pytest.mark.parametrize("section", SECTIONS)
def test_tp_layer_equivalence(results, section):
    tp, ranks = results
    counts = [rk[section][0] for rk in ranks]
    assert counts[0] > 0 and counts == [counts[0]] * tp  # every rank ran every check
    fails = [f"rank {i}: {f}" for i, rk in enumerate(ranks) for f in rk[section][1]]
    assert not fails, "\n".join(fails)


def test_size_one_group_is_the_identity_and_none_is_refused():
    """``SOLO`` (one process) communicates nothing: every mapping returns its input object. A
    forgotten group (``None``) is an error, not silently a group of one."""
    from megafp8.parallel import mappings as M

    x = torch.randn(4, 2, 4)
    with pytest.raises(TypeError):
        M.copy_to_tensor_parallel_region(x, None)
    for fn in (
        M.copy_to_tensor_parallel_region,
        M.reduce_from_tensor_parallel_region,
        M.scatter_to_tensor_parallel_region,
        M.gather_from_tensor_parallel_region,
        M.scatter_to_sequence_parallel_region,
        M.gather_from_sequence_parallel_region,
        M.reduce_scatter_to_sequence_parallel_region,
    ):
        assert fn(x, SOLO) is x
