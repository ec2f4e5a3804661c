"""Checkpoint layouts as one table of names and shapes, and MXFP4 (a leaf: it imports only torch).

A layout is a list of parts (the embedding, each decoder layer, the AttnRes queries, the head); a part is a list
of :class:`Row`: K3Model tensors ``ours`` ⇄ stored tensors ``stored``, related by a :class:`Form` that knows both
directions (``read``: stored → ours, ``write``: ours → stored). :mod:`k3course.pretrained` reads a folder with it
and :mod:`k3course.pretrained_save` writes one, so every name is written once, for every layout the package knows
(:func:`checkpoint_layout`: Kimi Linear, DeepSeek-V3 / Kimi K2, Kimi K3; the spellings transformers uses instead
of the released ones are :class:`Spelling`). The facts of the K3 layout (names, shapes) are the release's as its
public key maps spell them (torchtitan PRs #4025, #4281); the code is ours.

Per layer i of K3 (Kimi Linear's and DeepSeek's are the same names without the AttnRes, latent and g_proj
tensors; Kimi Linear's KDA has the low-rank output gate g_a_proj, g_b_proj; H heads, K = V head width, n / v MLA
widths, r latent rank, ℓ MoE latent, f expert width; ᵀ: transposed, since K3's FFNs compute x W)::

    input_layernorm / post_attention_layernorm         mixer_norm / ffn_norm
    self_attention_res_proj [1, d] / _norm [d]          residual.queries[2i] / residual.key_norms[2i]
    mlp_res_proj [1, d] / mlp_res_norm [d]              residual.queries[2i + 1] / residual.key_norms[2i + 1]
    KDA  q|k|v|b|o_proj, g_proj (full-rank gate)        mixer.q|k|v|b|o_proj, mixer.gate_proj
         q|k|v_conv1d [C, 1, W]                         mixer.q|k|v_conv [C, W]
         f_a_proj, f_b_proj, A_log [1, 1, H, 1], dt_bias [H·K], o_norm   mixer.f_proj.0|1, A_log [H], dt_bias [H, K]
    MLA  q_a_proj, q_a_layernorm, q_b_proj              mixer.q_down, q_norm, q_up
         kv_a_proj_with_mqa, kv_a_layernorm             mixer.kv_down, kv_norm
         kv_b_proj [H·(n + v), r]                       mixer.k_up [H, n, r], v_up [H, v, r]
         g_proj (output gate), o_proj                   mixer.gate, mixer.out
    mlp.gate|up|down_proj (dense layer)                 ffn.gate|up|down ᵀ
    block_sparse_moe.gate.weight [E, d], .e_score_correction_bias      ffn.router ᵀ, ffn.bias
         routed_expert_down_proj [ℓ, d], _up_proj [d, ℓ], _norm [ℓ]     ffn.down_proj ᵀ, up_proj ᵀ, latent_norm
         experts.j.w1|w3 [f, ℓ], w2 [ℓ, f]             ffn.experts.gate_up[j] = [w1ᵀ | w3ᵀ], down[j] = w2ᵀ
         shared_experts.gate|up|down_proj               ffn.shared.gate|up|down ᵀ
    model.output_attn_res_proj / _norm                  residual.queries[2L] / residual.key_norms[2L]

MXFP4 (OCP microscaling, compressed-tensors ``mxfp4-pack-quantized``): a weight [m, n] is stored as
``weight_packed`` uint8 [m, n/2], two 4-bit e2m1 codes per byte, the low nibble first, and ``weight_scale`` uint8
[m, n/32], one power-of-two exponent (bias 127) per 32 consecutive weights of a row. An e2m1 code is a sign bit
(bit 3) and one of eight magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (bits 0-2); W = value(code) · 2^(scale − 127).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0..7; code | 8 is the same magnitude negated
MXFP4_GROUP = 32  # weights that share one scale
E8M0_BIAS = 127  # a scale byte s means 2^(s − 127); 255 is NaN in the format and refused
E2M1_MAX_EXPONENT = 2  # 6 = 1.5 · 2²: a group's largest |w| sets its scale 2^(⌊log₂ max|w|⌋ − 2)


class LayoutError(ValueError):
    """A stored tensor whose shape or encoding the layout cannot read (named)."""


def _e2m1_values(device=None) -> torch.Tensor:
    """The 16 e2m1 code values in code order: +magnitudes, then −magnitudes (sign bit 3)."""
    magnitudes = torch.tensor(E2M1_MAGNITUDES, device=device)
    return torch.cat([magnitudes, -magnitudes])


def pack_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 of ``weight`` [..., n] (n a multiple of 32): (packed uint8 [..., n/2], scale uint8 [..., n/32]).

    Each group of 32 gets the exponent e = ⌊log₂ max|w|⌋ − 2 (so max|w| / 2^e ∈ [4, 8)), stored as e + 127 and
    clamped to [0, 254]; each weight becomes the nearest e2m1 value of w / 2^e (past 6 it saturates at ±6); two
    codes per byte, the even-indexed weight in the low nibble. An all-zero group stores exponent byte 0."""
    *lead, n = weight.shape
    if n % MXFP4_GROUP:
        raise LayoutError(f"weight: its last dimension ({n}) must be a multiple of {MXFP4_GROUP} for MXFP4")
    groups = weight.detach().float().reshape(*lead, n // MXFP4_GROUP, MXFP4_GROUP)
    largest = groups.abs().amax(-1, keepdim=True)
    exponent = torch.where(largest > 0, torch.floor(torch.log2(largest)) - E2M1_MAX_EXPONENT,
                           torch.full_like(largest, -E8M0_BIAS)).clamp(-E8M0_BIAS, 254 - E8M0_BIAS)
    codes = ((groups / torch.exp2(exponent)).unsqueeze(-1) - _e2m1_values(weight.device)).abs().argmin(-1)
    codes = codes.reshape(*lead, n).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), (exponent.squeeze(-1) + E8M0_BIAS).to(torch.uint8).contiguous()


def unpack_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                 name: str = "weight") -> torch.Tensor:
    """W [..., n] from ``packed`` uint8 [..., n/2] and ``scale`` uint8 [..., n/32] (see the module docstring),
    computed in fp32 and returned in ``dtype``; LayoutError naming ``name`` for another dtype or shape, or a
    scale byte 255 (NaN)."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise LayoutError(f"{name}: MXFP4 weight_packed and weight_scale must be uint8, got "
                          f"{packed.dtype} and {scale.dtype}")
    n = 2 * packed.shape[-1]
    if n % MXFP4_GROUP or tuple(scale.shape) != (*packed.shape[:-1], n // MXFP4_GROUP):
        raise LayoutError(f"{name}: weight_packed of shape {tuple(packed.shape)} needs weight_scale of shape "
                          f"{(*packed.shape[:-1], n // MXFP4_GROUP)}, got {tuple(scale.shape)}")
    if bool((scale == 255).any()):
        raise LayoutError(f"{name}: weight_scale holds 255, which MXFP4 reserves for NaN")
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).long()  # low nibble first
    factor = torch.exp2(scale.float() - E8M0_BIAS).repeat_interleave(MXFP4_GROUP, dim=-1)
    return (_e2m1_values(packed.device)[codes] * factor).to(dtype)


# --- forms: how stored tensors relate to K3Model's ----------------------------------------------------------

Get = Callable[[str], torch.Tensor]


class Form:
    """Both directions of one row: ``read(get, stored, cfg)`` -> K3 tensors (one per ``ours`` name) from the
    stored tensors ``get(name)``; ``write(tensors, cfg)`` -> the stored tensors (one per ``stored`` name)."""

    def read(self, get: Get, stored: tuple[str, ...], cfg) -> list[torch.Tensor]:
        raise NotImplementedError

    def write(self, tensors: list[torch.Tensor], cfg) -> list[torch.Tensor]:
        raise NotImplementedError


class Same(Form):
    """Stored as K3 holds it."""

    def read(self, get, stored, cfg):
        return [get(stored[0])]

    def write(self, tensors, cfg):
        return [tensors[0]]


class Transposed(Form):
    """Stored with the last two dimensions swapped: nn.Linear's [out, in] for K3's x W weights [in, out]."""

    def read(self, get, stored, cfg):
        return [get(stored[0]).mT]

    def write(self, tensors, cfg):
        return [tensors[0].mT]


@dataclass(frozen=True)
class Reshaped(Form):
    """The same numbers in another shape: stored ``stored_shape(cfg)``, K3 ``our_shape(cfg)``, which the config's
    ``settings(cfg)`` (named when a stored tensor has another size) imply."""

    stored_shape: Callable[[object], tuple[int, ...]]
    our_shape: Callable[[object], tuple[int, ...]]
    settings: Callable[[object], str]

    def read(self, get, stored, cfg):
        return [_reshaped(get(stored[0]), self.our_shape(cfg), stored[0], self.settings(cfg))]

    def write(self, tensors, cfg):
        return [tensors[0].reshape(self.stored_shape(cfg))]


class KeyValueUp(Form):
    """MLA's kv_b_proj [H·(n + v), r] ⇄ k_up [H, n, r] and v_up [H, v, r]."""

    def read(self, get, stored, cfg):
        shape = (cfg.mla_n_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        settings = (f"num_attention_heads {cfg.mla_n_heads}, qk_nope_head_dim {cfg.qk_nope_head_dim}, v_head_dim "
                    f"{cfg.v_head_dim} and kv_lora_rank {cfg.kv_lora_rank}")
        both = _reshaped(get(stored[0]), shape, stored[0], settings)
        return [both[:, :cfg.qk_nope_head_dim], both[:, cfg.qk_nope_head_dim:]]

    def write(self, tensors, cfg):
        return [torch.cat(tensors, dim=1).flatten(0, 1)]


class PerExpert(Form):
    """Routed experts: ``stored`` lists, expert by expert, the transposed column blocks of the one K3 tensor
    [E, in, out] (gate_up = [w1ᵀ | w3ᵀ]: two blocks of f columns; down = w2ᵀ: one block). Read into one
    preallocated tensor, one stored (or dequantized) tensor at a time."""

    def __init__(self, blocks: int):
        self.blocks = blocks  # stored tensors per expert

    def read(self, get, stored, cfg):
        blocks = self.blocks
        out = None
        for index, name in enumerate(stored):
            piece = get(name).T
            if out is None:
                out = torch.empty(cfg.n_routed_experts, piece.shape[0], blocks * piece.shape[1], dtype=piece.dtype)
            j, block = divmod(index, blocks)
            width = out.shape[-1] // blocks
            if tuple(piece.shape) != (out.shape[1], width):
                raise LayoutError(f"checkpoint: tensor {name} has shape {tuple(piece.T.shape)}, expected "
                                  f"{(width, out.shape[1])} like the other experts")
            out[j, :, block * width:(block + 1) * width] = piece
        return [out]

    def write(self, tensors, cfg):
        (stacked,) = tensors
        return [part.T for j in range(cfg.n_routed_experts) for part in stacked[j].chunk(self.blocks, dim=-1)]


class PerRead(Form):
    """AttnRes: the rows of one K3 tensor [2L + 1, d] (a query or key-norm weight per read), each stored on its
    own as [1, d] (``*_res_proj``: a linear map to one logit) or [d] (``*_res_norm``)."""

    def __init__(self, stored_shape: tuple[int, ...] | None):
        self.stored_shape = stored_shape  # (1,) for [1, d], () for [d]

    def read(self, get, stored, cfg):
        return [torch.stack([_reshaped(get(name), (cfg.d_model,), name, f"hidden_size {cfg.d_model}")
                             for name in stored])]

    def write(self, tensors, cfg):
        return [row.reshape(*self.stored_shape, cfg.d_model) for row in tensors[0]]


def _reshaped(tensor: torch.Tensor, shape: tuple[int, ...], name: str, settings: str) -> torch.Tensor:
    """``tensor`` as ``shape``; LayoutError naming it and the config's ``settings`` when its size differs."""
    if tensor.numel() != math.prod(shape):
        raise LayoutError(f"checkpoint: tensor {name} has shape {tuple(tensor.shape)}, but config.json's {settings} "
                          f"make it {shape}")
    return tensor.reshape(shape)


@dataclass(frozen=True)
class Row:
    """K3Model tensors ``ours`` ⇄ stored tensors ``stored``, related by ``form``."""

    ours: tuple[str, ...]
    stored: tuple[str, ...]
    form: Form

    def read(self, get: Get, cfg) -> dict[str, torch.Tensor]:
        return dict(zip(self.ours, self.form.read(get, self.stored, cfg), strict=True))

    def write(self, state: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
        return dict(zip(self.stored, self.form.write([state[name] for name in self.ours], cfg), strict=True))


def rows(pairs: dict[str, str], form: Form, ours: str = "", stored: str = "") -> list[Row]:
    """One row per {our name: stored name} pair, prefixed, all of one form."""
    return [Row((ours + mine,), (stored + theirs,), form) for mine, theirs in pairs.items()]


# --- the table: every layout the package knows -------------------------------------------------------------

@dataclass(frozen=True)
class Spelling:
    """Which of the equivalent spellings a checkpoint's layer uses. The defaults are the released Kimi Linear and
    K3 names, which the course writes; transformers' Kimi Linear and DeepSeek-V3 read with the others."""

    dense: str = "mlp."  # where a dense layer's FFN is stored
    moe: str = "block_sparse_moe."  # where an MoE layer's FFN is stored (transformers, DeepSeek: "mlp.")
    experts: str = "w"  # per-expert w1|w3|w2 ("w"), gate_proj|up_proj|down_proj ("proj"), or fused ("fused")
    conv: str = "split"  # q|k|v_conv1d, or the three stacked in one conv1d ("stacked")
    gate: str = ""  # where KDA's forget gate (f_a|f_b_proj, A_log, dt_bias) sits ("forget_gate." in transformers)


RELEASED = Spelling()
SAME, TRANSPOSED = Same(), Transposed()
KDA_SAME = {f"{name}.weight": f"{name}.weight" for name in ("q_proj", "k_proj", "v_proj", "b_proj", "o_proj")} | {
    "o_norm_weight": "o_norm.weight"}
FORGET_GATE = {"f_proj.0.weight": "f_a_proj.weight", "f_proj.1.weight": "f_b_proj.weight"}
MLA_SAME = {"kv_down.weight": "kv_a_proj_with_mqa.weight", "kv_norm.weight": "kv_a_layernorm.weight",
            "out.weight": "o_proj.weight"}
Q_LOW_RANK = {"q_down.weight": "q_a_proj.weight", "q_norm.weight": "q_a_layernorm.weight",
              "q_up.weight": "q_b_proj.weight"}
GLU = {"gate": "gate_proj.weight", "up": "up_proj.weight", "down": "down_proj.weight"}
EXPERT_NAMES = {"w": ("w1", "w3", "w2"), "proj": ("gate_proj", "up_proj", "down_proj")}
LATENT = {"down_proj": "routed_expert_down_proj.weight", "up_proj": "routed_expert_up_proj.weight"}
RES = ("self_attention_res", "mlp_res")  # the two reads of a layer: before its mixer, before its FFN
TEXT = "model."  # the stored text model; the K3 release nests it as language_model.model.


class StackedConv(Form):
    """transformers' one conv1d [3C, 1, W] ⇄ the q, k, v convolutions [C, W]."""

    def read(self, get, stored, cfg):
        return list(get(stored[0]).squeeze(1).chunk(3))

    def write(self, tensors, cfg):
        return [torch.cat(tensors).unsqueeze(1)]


def _kda_rows(cfg, spelling: Spelling, ours: str, stored: str) -> list[Row]:
    heads, width = cfg.kda_n_heads, cfg.kda_head_dim
    settings = lambda c: f"linear num_heads {c.kda_n_heads} and head_dim {c.kda_head_dim}"  # noqa: E731
    gate = stored + spelling.gate
    if spelling.conv == "stacked":
        convs = [Row(tuple(f"{ours}{x}_conv.weight" for x in "qkv"), (stored + "conv1d.weight",), StackedConv())]
    else:
        conv = Reshaped(lambda c: (c.kda_n_heads * c.kda_head_dim, 1, c.kda_conv_size),
                        lambda c: (c.kda_n_heads * c.kda_head_dim, c.kda_conv_size),
                        lambda c: settings(c) + f" and short_conv_kernel_size {c.kda_conv_size}")
        convs = rows({f"{x}_conv.weight": f"{x}_conv1d.weight" for x in "qkv"}, conv, ours, stored)
    if cfg.kda_output_gate == "full":
        output_gate = {"gate_proj.weight": "g_proj.weight"}
    else:
        output_gate = {"gate_proj.0.weight": "g_a_proj.weight", "gate_proj.1.weight": "g_b_proj.weight"}
        output_gate |= {"gate_proj.1.bias": "g_b_proj.bias"} if cfg.kda_gate_bias else {}
    return (rows(KDA_SAME | output_gate, SAME, ours, stored) + rows(FORGET_GATE, SAME, ours, gate)
            + rows({"A_log": "A_log"}, Reshaped(lambda c: (1, 1, heads, 1), lambda c: (heads,), settings), ours, gate)
            + rows({"dt_bias": "dt_bias"}, Reshaped(lambda c: (heads * width,), lambda c: (heads, width), settings),
                   ours, gate) + convs)


def _mla_rows(cfg, ours: str, stored: str) -> list[Row]:
    query = {"q_up.weight": "q_proj.weight"} if cfg.q_lora_rank is None else Q_LOW_RANK
    gate = {"gate.weight": "g_proj.weight"} if cfg.mla_gated else {}
    return (rows(MLA_SAME | query | gate, SAME, ours, stored)
            + [Row((ours + "k_up", ours + "v_up"), (stored + "kv_b_proj.weight",), KeyValueUp())])


def _expert_rows(cfg, spelling: Spelling, ours: str, stored: str) -> list[Row]:
    if spelling.experts == "fused":  # transformers: [E, 2f, d] with the gate rows first, and [E, d, f]
        return rows({"gate_up": "gate_up_proj", "down": "down_proj"}, TRANSPOSED, ours + "experts.",
                    stored + "experts.")
    gate, up, down = EXPERT_NAMES[spelling.experts]
    experts = range(cfg.n_routed_experts)
    return [Row((ours + "experts.gate_up",), tuple(f"{stored}experts.{j}.{w}.weight" for j in experts
                                                   for w in (gate, up)), PerExpert(2)),
            Row((ours + "experts.down",), tuple(f"{stored}experts.{j}.{down}.weight" for j in experts), PerExpert(1))]


def _moe_rows(cfg, spelling: Spelling, ours: str, stored: str) -> list[Row]:
    out = (rows({"router": "gate.weight"}, TRANSPOSED, ours, stored)
           + rows({"bias": "gate.e_score_correction_bias"}, SAME, ours, stored)
           + _expert_rows(cfg, spelling, ours, stored))
    if cfg.latent_dim is not None:
        out += (rows({"latent_norm": "routed_expert_norm.weight"}, SAME, ours, stored)
                + rows(LATENT, TRANSPOSED, ours, stored))
    if cfg.n_shared_experts:
        out += rows(GLU, TRANSPOSED, ours + "shared.", stored + "shared_experts.")
    return out


def layer_rows(cfg, i: int, spelling: Spelling = RELEASED) -> list[Row]:
    """Decoder layer i: its two norms, its mixer (KDA or MLA, as ``cfg`` builds them) under ``self_attn.``, its FFN
    (dense, or the MoE with its latent projections and shared experts) under the spelling's prefix."""
    ours, stored = f"layers.{i}.", f"{TEXT}layers.{i}."
    out = rows({"mixer_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight"},
               SAME, ours, stored)
    if cfg.layer_types()[i] == "kda":
        out += _kda_rows(cfg, spelling, ours + "mixer.", stored + "self_attn.")
    else:
        out += _mla_rows(cfg, ours + "mixer.", stored + "self_attn.")
    if cfg.ffn_types()[i] == "dense":
        return out + rows(GLU, TRANSPOSED, ours + "ffn.", stored + spelling.dense)
    return out + _moe_rows(cfg, spelling, ours + "ffn.", stored + spelling.moe)


def attnres_rows(cfg) -> list[Row]:
    """Block AttnRes: every read's query (and key-norm weight, with ``attnres_key_weight``), stored per layer as
    ``self_attention_res_*`` and ``mlp_res_*`` and once as ``output_attn_res_*``."""
    reads = [f"{TEXT}layers.{i}.{res}" for i in range(cfg.n_layers) for res in RES] + [TEXT + "output_attn_res"]
    out = [Row(("residual.queries",), tuple(f"{read}_proj.weight" for read in reads), PerRead((1,)))]
    if cfg.attnres_key_weight:
        out.append(Row(("residual.key_norms",), tuple(f"{read}_norm.weight" for read in reads), PerRead(())))
    return out


def checkpoint_layout(cfg, spelling: Callable[[int], Spelling] = lambda i: RELEASED) -> list[list[Row]]:
    """The layout of a config's checkpoint, part by part: the embedding, each decoder layer (``spelling(i)``), the
    AttnRes reads (Block AttnRes only), the final norm and the head (none stored when tied). One table for every
    layout the package knows: Kimi Linear and DeepSeek-V3 / Kimi K2 (PreNorm; their layers as the config says)
    and Kimi K3 (full-rank gates, gated MLA, latent MoE, Block AttnRes)."""
    parts = [[Row(("embed.weight",), (TEXT + "embed_tokens.weight",), SAME)]]
    parts += [layer_rows(cfg, i, spelling(i)) for i in range(cfg.n_layers)]
    if cfg.residual == "block_attnres":
        parts.append(attnres_rows(cfg))
    head = [Row(("final_norm.weight",), (TEXT + "norm.weight",), SAME)]
    if not cfg.tie_embeddings:
        head.append(Row(("lm_head.weight",), ("lm_head.weight",), SAME))
    return parts + [head]


def is_routed_expert(name: str) -> bool:
    """Whether stored tensor ``name`` is a routed expert's weight (the tensors the K3 release ships in MXFP4)."""
    return ".block_sparse_moe.experts." in name and name.endswith(".weight")
