"""Three FP8 forward and backward passes of one te.LayerNormMLP (RMSNorm, SwiGLU, delayed
scaling), for comparing a kernel put into TE with TE's own."""

import torch


def three_passes(bias: bool):
    """(outputs and input gradients of three passes, {parameter: gradient}) of a te.LayerNormMLP
    256 -> 704 -> 256 in bf16; weights, biases and inputs from seed 0, so every call starts from
    the same values; the FP8 scales move between the passes (amax history 4)."""
    import transformer_engine.common.recipe as ter
    import transformer_engine.pytorch as te

    torch.manual_seed(0)
    model = te.LayerNormMLP(256, 704, bias=bias, normalization="RMSNorm", activation="swiglu",
                            params_dtype=torch.bfloat16)  # fmt: skip
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "bias" in name:
                p.normal_(0, 0.1)
    recipe = ter.DelayedScaling(fp8_format=ter.Format.HYBRID, amax_history_len=4)
    xs = [torch.randn(128, 2, 256, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    dys = [torch.randn_like(x) * 1e-2 for x in xs]
    outs = []
    for x, dy in zip(xs, dys, strict=True):
        x = x.clone().requires_grad_(True)
        with te.autocast(enabled=True, recipe=recipe):
            y = model(x)
        y.backward(dy)
        outs += [y.detach(), x.grad]
    return outs, {n: p.grad for n, p in model.named_parameters()}
