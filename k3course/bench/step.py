"""bench step: where one K3 training step (forward + backward + AdamW) spends its time, by component.

The whole step is timed as the training loop runs it. Each component is then timed forward + backward on the
exact inputs it saw in that step (captured by hooks), so the rows are the cost of that part of the model:

    embedding · KDA mixers · MLA mixers · dense FFN · MoE routing · MoE experts · MoE dispatch + combine + shared
    · AttnRes (residual reads and writes) + RMSNorms · LM head + loss · optimizer

``other`` is the step minus their sum (autograd bookkeeping, the parts' interaction with the cache of a larger
working set); it is reported, not hidden. Ratios and shares come from one run.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from k3course.bench import best_seconds
from k3course.config import K3Config
from k3course.model import K3Model
from k3course.moe.dispatch import sort_by_expert
from k3course.moe.layers import MoE


def _options(options: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="k3course bench step", description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"], help="K3Config presets to time")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (the best is reported)")
    parser.add_argument("--plot", default=None, help="save a stacked bar of the breakdown to this PNG")
    args = parser.parse_args(options)
    for name in ("batch", "seq", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be ≥ 1, got {getattr(args, name)}")
    return args


def _fwd_bwd(fn, *inputs: torch.Tensor) -> float:
    """Best time of y = fn(*inputs); y.backward(ones) with fresh leaf copies of the inputs (the floating ones
    require grad; integer inputs such as token ids pass through)."""
    def run():
        leaves = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
        out = fn(*leaves)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(torch.ones_like(out))
    return best_seconds(run, repeats=3)


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


def _moe_parts(moe: MoE, x: torch.Tensor) -> dict[str, float]:
    """Routing (router matmul, scores, top-k) and the routed experts' GEMMs, forward + backward; the rest of
    the layer (sort, gather, unsort, latent projections, combine, shared experts) is what remains."""
    flat = x.reshape(-1, moe.d_model)
    with torch.no_grad():
        _, _, expert_idx, _ = moe.route(flat)
        z = flat @ moe.down_proj if moe.d_latent is not None else flat
        order, offsets = sort_by_expert(expert_idx, moe.n_routed)
        z_sorted = z.index_select(0, order // moe.top_k)
    routing = _fwd_bwd(lambda h: moe.route(h)[3], flat)
    experts = _fwd_bwd(lambda rows: moe.experts(rows, offsets), z_sorted)
    whole = _fwd_bwd(moe, x)
    return {"MoE routing": routing, "MoE experts": experts,
            "MoE dispatch + combine + shared": max(whole - routing - experts, 0.0)}


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
