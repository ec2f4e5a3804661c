"""bench step: where one K3 training step (forward + backward + AdamW) spends its time, by component.

The whole step is timed as the training loop runs it. Each component is then timed forward + backward on the
exact inputs it saw in that step (captured by hooks), so the rows are the cost of that part of the model:

    embedding · KDA mixers · MLA mixers · dense FFN · the MoE layers, stage by stage · AttnRes (residual reads
    and writes) + RMSNorms · LM head + loss · optimizer

The MoE layers' time (forward + backward of each layer on its input) is split over the stages the layer names
as profiler ranges (route, down projection, dispatch, experts, combine, shared, and what runs outside them), in
the shares a profiled run of the same call gives (:func:`~k3course.bench.range_seconds`): the real layer, not
a copy of its forward. ``other`` is the step minus the sum of the rows (autograd bookkeeping, the parts'
interaction with the cache of a larger working set); it is reported, not hidden. Ratios and shares come from
one run.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from k3course.bench import add_options, apply_options, best_seconds, profile_calls, range_seconds
from k3course.config import K3Config
from k3course.model import K3Model
from k3course.moe.layers import MoE


def _options(options: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="k3course bench step", description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"], help="K3Config presets to time")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--plot", default=None, help="save a stacked bar of the breakdown to this PNG")
    add_options(parser, threads=0, repeats=3)
    args = parser.parse_args(options)
    for name in ("batch", "seq"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be ≥ 1, got {getattr(args, name)}")
    return args


def _fwd_bwd_call(fn, *inputs: torch.Tensor):
    """A call of y = fn(*inputs); y.backward(ones) with fresh leaf copies of the inputs (the floating ones
    require grad; integer inputs such as token ids pass through)."""
    def run():
        leaves = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
        out = fn(*leaves)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(torch.ones_like(out))
    return run


def _fwd_bwd(fn, *inputs: torch.Tensor) -> float:
    """Best time of :func:`_fwd_bwd_call` over 3 calls."""
    return best_seconds(_fwd_bwd_call(fn, *inputs), repeats=3)


def _capture(model: K3Model, tokens: torch.Tensor, targets: torch.Tensor) -> dict:
    """The inputs each component saw in one training forward, and the sub-layer outputs in order."""
    seen: dict = {"mixer_in": {}, "ffn_in": {}, "outputs": []}
    hooks = []
    for index, layer in enumerate(model.layers):
        hooks.append(layer.mixer.register_forward_pre_hook(
            lambda m, args, i=index: seen["mixer_in"].__setitem__(i, args[0].detach())))
        hooks.append(layer.ffn.register_forward_pre_hook(
            lambda m, args, i=index: seen["ffn_in"].__setitem__(i, args[0].detach())))
        for part in (layer.mixer, layer.ffn):
            hooks.append(part.register_forward_hook(
                lambda m, args, out: seen["outputs"].append((out[0] if isinstance(out, tuple) else out).detach())))
    hooks.append(model.final_norm.register_forward_hook(lambda m, args, out: seen.__setitem__("hidden", out.detach())))
    try:
        model(tokens, targets=targets)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def _moe_parts(moe: MoE, x: torch.Tensor, calls: int = 2) -> dict[str, float]:
    """The layer's forward + backward on x (best of 3), split over its profiler ranges in the shares of ``calls``
    profiled calls: {"MoE <stage>": seconds, ..., "MoE outside the ranges": seconds}; the rows add up to the
    layer's time."""
    call = _fwd_bwd_call(moe, x)
    whole = best_seconds(call, repeats=3)
    events, profiled = profile_calls(call, calls)
    shares = {stage: seconds / profiled for stage, seconds in range_seconds(events, "moe.", calls).items()}
    shares["outside the ranges"] = 1 - sum(shares.values())
    return {f"MoE {stage}": whole * share for stage, share in shares.items()}


def _attnres_and_norms(model: K3Model, embedding: torch.Tensor, outputs: list[torch.Tensor]) -> float:
    """The residual scheme's reads and writes plus the sub-layer RMSNorms, on the step's real sub-layer outputs."""
    norms = [norm for layer in model.layers for norm in (layer.mixer_norm, layer.ffn_norm)]

    def stack(v0, *outs):
        stream, total = model.residual.begin(v0), 0
        for norm, out in zip(norms, outs):
            total = total + norm(stream.read()).sum()
            stream.write(out)
        return model.final_norm(stream.final()).sum() + total
    return _fwd_bwd(stack, embedding, *outputs)


def breakdown(cfg: K3Config, batch: int, seq: int, repeats: int) -> tuple[float, dict[str, float]]:
    """(step seconds, {component: seconds}) for one AdamW training step of K3Model(cfg) on random tokens."""
    torch.manual_seed(0)
    model = K3Model.from_config(cfg).train()
    optimizer = torch.optim.AdamW(model.param_groups(0.1), lr=1e-3)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def step():
        optimizer.zero_grad(set_to_none=True)
        model(inputs, targets=targets)[1].backward()
        optimizer.step()
    step_seconds = best_seconds(step, repeats=repeats)
    seen = _capture(model, inputs, targets)
    parts = {"embedding": _fwd_bwd(model.embed, inputs)}  # the lookup and its scatter-add into the table
    for kind in ("kda", "mla"):
        parts[f"{kind.upper()} mixers"] = sum(_fwd_bwd(layer.mixer, seen["mixer_in"][i])
                                             for i, layer in enumerate(model.layers) if layer.mixer_kind == kind)
    parts["dense FFN"] = sum(_fwd_bwd(layer.ffn, seen["ffn_in"][i])
                             for i, layer in enumerate(model.layers) if layer.ffn_kind == "dense")
    for i, layer in enumerate(model.layers):
        if layer.ffn_kind == "moe":
            for name, seconds in _moe_parts(layer.ffn, seen["ffn_in"][i]).items():
                parts[name] = parts.get(name, 0.0) + seconds
    parts["AttnRes + RMSNorms"] = _attnres_and_norms(model, model.embed(inputs).detach(), seen["outputs"])
    head = model.lm_head or (lambda h: h @ model.embed.weight.T)
    parts["LM head + loss"] = _fwd_bwd(
        lambda h: F.cross_entropy(head(h).flatten(0, 1), targets.flatten()), seen["hidden"])
    parts["optimizer"] = best_seconds(optimizer.step, repeats=repeats)
    parts["other"] = step_seconds - sum(parts.values())
    return step_seconds, parts


def _plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(next(iter(results.values()))[1])
    for column, (step_seconds, parts) in enumerate(results.values()):
        bottom = 0.0
        for index, name in enumerate(names):
            share = max(parts[name], 0.0) / step_seconds
            ax.bar(column, share, bottom=bottom, color=plt.cm.tab20(index), label=name if column == 0 else None)
            bottom += share
    ax.set_xticks(range(len(results)), list(results))
    ax.set_ylabel("share of one training step")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(options: list[str]) -> int:
    args = _options(options)
    print(f"settings: {apply_options(args.threads, args.return_freed_memory)}")
    results = {}
    for preset in args.presets:
        cfg = K3Config.preset(preset)
        start = time.perf_counter()
        step_seconds, parts = breakdown(cfg, args.batch, args.seq, args.repeats)
        results[preset] = (step_seconds, parts)
        tokens = args.batch * args.seq
        print(f"{preset}: one AdamW step on {args.batch} x {args.seq} tokens, {torch.get_num_threads()} CPU "
              f"thread(s): {step_seconds * 1e3:.0f} ms, {tokens / step_seconds:,.0f} tokens/s "
              f"(bench took {time.perf_counter() - start:.0f} s)")
        for name, seconds in parts.items():
            print(f"  {name:<32} {seconds * 1e3:9.1f} ms  {seconds / step_seconds:6.1%}")
    if args.plot:
        _plot(results, args.plot)
        print(f"plot saved to {args.plot}")
    return 0
