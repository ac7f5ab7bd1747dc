"""Traces shaped to mislead the analyzer (issue 32), captured on the CPU with module frames.

Each capture builds tiny models with random weights (float32; widths chosen so that linears
whose real shapes differ keep different (K, N)), runs them under torch.profiler
(record_shapes, with_stack, with_modules; warm-up before the profiler, each step in a
`ProfilerStep#N` range) and writes `<out>/<name>_cpu.json.gz` holding two metadata objects:
`trace_roofline_workload` (what ran) and `trace_roofline_modules`, the profiler's name of every
module instance called (`Linear_3`) -> its qualified name (`model.layers.0.self_attn.q_proj`),
the truth tests/attribution/test_misleading.py checks the analyzer's names against. Each HF model's config
is written beside the traces as `<out>/<name>[_draft].config.json`.

- `llama_beam4`: a tiny Llama's `generate(num_beams=4)`;
- `deepseek_v2_moe`, `deepseek_v3_moe`: HF DeepSeek-V2/V3 prefill, 1 dense + 2 MoE layers of 8
  routed experts (top-2) and one shared expert of the routed experts' width;
- `gemma3_qk_norm`: HF Gemma-3 text prefill (per-head q/k RMSNorm);
- `plain_block`: `PlainLM`, a decoder written with nn.Linear (q, k, v, out, fc1, fc2);
- `t5_dit`: a tiny T5 encoder, then `DiT` blocks with adaLN modulation;
- `vit_encoder`, `bert_encoder`, `videomae_encoder`: ViT, BERT (masked LM), VideoMAE forwards;
- `llama_train`: forward, loss, backward and AdamW of a tiny Llama;
- `llama_assisted`: assisted decoding, a tiny Llama and a tinier draft Llama.

    python -m workloads.capture_misleading --out sample_traces/misleading [--only NAME,...]
"""

from __future__ import annotations

import argparse
import gzip
import json
import platform
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Step = Callable[[], object]
VOCAB = 384
# tiny Llama: q/o 64x64, k/v 64x32, gate/up 64x176, down 176x64, lm_head 64x384
LLAMA = dict(hidden_size=64, intermediate_size=176, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=256)
# the draft: q/o 32x32, k/v 32x16, gate/up 32x96, down 96x32
DRAFT = dict(LLAMA, hidden_size=32, intermediate_size=96, num_attention_heads=2,
             num_key_value_heads=1, num_hidden_layers=1)
# MLA with 8 routed experts (top-2) of width 48 and one shared expert of the same width
DEEPSEEK = dict(hidden_size=64, intermediate_size=192, moe_intermediate_size=48,
                num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=3,
                first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=1,
                num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=32,
                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, head_dim=8,
                vocab_size=VOCAB, max_position_embeddings=256)
GEMMA3 = dict(hidden_size=64, intermediate_size=176, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, num_hidden_layers=2, vocab_size=VOCAB, sliding_window=16,
              layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256)
ENCODER = dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_hidden_layers=2)
PROMPT, BATCH = 16, 2  # tokens per sequence and sequences of the forward-only captures


class _Attention(nn.Module):
    """Multi-head attention from nn.Linear: q, k, v, out (keys and values from `ctx`)."""

    def __init__(self, dim: int, heads: int, ctx_dim: int | None = None) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.out = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.k, self.v = nn.Linear(ctx_dim or dim, dim), nn.Linear(ctx_dim or dim, dim)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor | None = None,
                causal: bool = False) -> torch.Tensor:
        src = x if ctx is None else ctx
        b, t, d = x.shape

        def split(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, -1, self.heads, d // self.heads).transpose(1, 2)

        o = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(src)),
                                           split(self.v(src)), is_causal=causal)
        return self.out(o.transpose(1, 2).reshape(b, t, d))


class _Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class _Block(nn.Module):
    """Pre-LayerNorm decoder block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn, self.mlp = _Attention(dim, heads), _Mlp(dim, 4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), causal=True)
        return x + self.mlp(self.ln2(x))


class PlainLM(nn.Module):
    """A GPT-like decoder in plain torch: attention q/k/v/out 48x48, MLP fc1 48x192 and
    fc2 192x48, LayerNorms, an embedding and an lm_head 48x320."""

    def __init__(self, vocab: int = 320, dim: int = 48, heads: int = 4, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(_Block(dim, heads) for _ in range(layers))
        self.ln_f, self.lm_head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class _DiTBlock(nn.Module):
    """DiT block: adaLN modulation (a Linear from the conditioning to 6·D: shift, scale and
    gate of attention and MLP), self-attention, cross-attention to the text, MLP."""

    def __init__(self, dim: int, heads: int, text_dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False)
        self.norm_cross = nn.LayerNorm(dim)
        self.attn, self.cross = _Attention(dim, heads), _Attention(dim, heads, text_dim)
        self.mlp = _Mlp(dim, 4 * dim)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def forward(self, x: torch.Tensor, c: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        s1, b1, g1, s2, b2, g2 = self.adaLN_modulation(c).unsqueeze(1).chunk(6, dim=-1)
        x = x + g1 * self.attn(self.norm1(x) * (1 + b1) + s1)
        x = x + self.cross(self.norm_cross(x), ctx=text)
        return x + g2 * self.mlp(self.norm2(x) * (1 + b2) + s2)


class DiT(nn.Module):
    """A DiT-like denoiser of D=96 over 16-dim latent patches: patch embedding 16x96, timestep
    MLP 32x96 / 96x96, pooled-text projection 64x96, blocks (adaLN 96x576, q/k/v/out 96x96,
    cross k/v 64x96, fc1 96x384, fc2 384x96), final adaLN 96x192 and projection 96x16."""

    def __init__(self, text_dim: int = 64, dim: int = 96, heads: int = 4, layers: int = 2,
                 patch: int = 16, freq: int = 32) -> None:
        super().__init__()
        self.freq = freq
        self.patch_embed = nn.Linear(patch, dim)
        self.t_embedder = nn.Sequential(nn.Linear(freq, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.text_pool = nn.Linear(text_dim, dim)
        self.blocks = nn.ModuleList(_DiTBlock(dim, heads, text_dim) for _ in range(layers))
        self.norm_out = nn.LayerNorm(dim, elementwise_affine=False)
        self.final_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))
        self.proj_out = nn.Linear(dim, patch)

    def forward(self, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        half = torch.arange(self.freq // 2, dtype=x.dtype) / (self.freq // 2)
        angles = t[:, None] * torch.exp(-9.2 * half)[None]
        c = self.t_embedder(torch.cat([angles.cos(), angles.sin()], -1))
        c = c + self.text_pool(text.mean(1))
        h = self.patch_embed(x)
        for block in self.blocks:
            h = block(h, c, text)
        shift, scale = self.final_modulation(c).unsqueeze(1).chunk(2, dim=-1)
        return self.proj_out(self.norm_out(h) * (1 + scale) + shift)


def _hf(model_type: str, fields: dict[str, Any], factory: str, seed: int = 0
        ) -> tuple[nn.Module, dict[str, Any]]:
    """A transformers model of `model_type` from `fields` (random weights), and its config."""
    import transformers

    cfg = transformers.AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    model = getattr(transformers, factory)(cfg).eval()
    return model, cfg.to_dict()


def _ids(n: int, batch: int = 1) -> torch.Tensor:
    return torch.randint(2, VOCAB, (batch, n))


def beam() -> tuple[dict[str, nn.Module], Step, dict[str, dict]]:
    m, cfg = _hf("llama", LLAMA, "LlamaForCausalLM")
    ids = _ids(8)
    return {"": m}, lambda: m.generate(ids, num_beams=4, max_new_tokens=4, min_new_tokens=4,
                                       do_sample=False, pad_token_id=0), {"": cfg}


def _prefill(model_type: str, fields: dict[str, Any], factory: str
             ) -> Callable[[], tuple[dict[str, nn.Module], Step, dict[str, dict]]]:
    def make() -> tuple[dict[str, nn.Module], Step, dict[str, dict]]:
        m, cfg = _hf(model_type, fields, factory)
        ids = _ids(PROMPT, BATCH)
        return {"": m}, lambda: m(input_ids=ids, use_cache=False), {"": cfg}
    return make


def plain() -> tuple[dict[str, nn.Module], Step, dict[str, dict]]:
    torch.manual_seed(0)
    m = PlainLM().eval()
    ids = torch.randint(0, 320, (BATCH, 32))
    return {"": m}, lambda: m(ids), {}


def t5_dit() -> tuple[dict[str, nn.Module], Step, dict[str, dict]]:
    """T5 encoder (d_model 64, d_ff 160, 2 layers) over 12 prompt tokens, then one DiT step
    over 64 latent patches, both at batch 2."""
    t5, cfg = _hf("t5", dict(d_model=64, d_kv=16, d_ff=160, num_heads=4, num_layers=2,
                             vocab_size=VOCAB), "T5EncoderModel")
    torch.manual_seed(1)
    dit = DiT().eval()
    ids, latents, t = _ids(12, BATCH), torch.randn(BATCH, 64, 16), torch.tensor([500.0, 20.0])

    def step() -> torch.Tensor:
        return dit(latents, t, t5(input_ids=ids).last_hidden_state)
    return {"text_encoder": t5, "transformer": dit}, step, {"": cfg}


def vit() -> tuple[dict[str, nn.Module], Step, dict[str, dict]]:
    m, cfg = _hf("vit", dict(ENCODER, image_size=32, patch_size=8, num_labels=10),
                 "ViTForImageClassification")
    x = torch.randn(BATCH, 3, 32, 32)
    return {"": m}, lambda: m(pixel_values=x), {"": cfg}


def bert() -> tuple[dict[str, nn.Module], Step, dict[str, dict]]:
    m, cfg = _hf("bert", dict(ENCODER, vocab_size=VOCAB), "BertForMaskedLM")
    ids = _ids(PROMPT, BATCH)
    return {"": m}, lambda: m(input_ids=ids), {"": cfg}


def videomae() -> tuple[dict[str, nn.Module], Step, dict[str, dict]]:
    m, cfg = _hf("videomae", dict(ENCODER, image_size=32, patch_size=8, num_frames=4,
                                  tubelet_size=2, num_labels=10),
                 "VideoMAEForVideoClassification")
    x = torch.randn(BATCH, 4, 3, 32, 32)
    return {"": m}, lambda: m(pixel_values=x), {"": cfg}


def train() -> tuple[dict[str, nn.Module], Step, dict[str, dict]]:
    m, cfg = _hf("llama", LLAMA, "LlamaForCausalLM")
    m.train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    ids = _ids(PROMPT, BATCH)

    def step() -> torch.Tensor:
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return {"": m}, step, {"": cfg}


def assisted() -> tuple[dict[str, nn.Module], Step, dict[str, dict]]:
    m, cfg = _hf("llama", LLAMA, "LlamaForCausalLM")
    d, dcfg = _hf("llama", DRAFT, "LlamaForCausalLM", seed=1)
    ids = _ids(8)
    return {"target": m, "draft": d}, lambda: m.generate(
        ids, assistant_model=d, max_new_tokens=6, min_new_tokens=6, do_sample=False,
        pad_token_id=0), {"": cfg, "draft": dcfg}


def bart_generate() -> tuple[dict[str, nn.Module], Step, dict[str, dict]]:
    """BART (H 64, 2 + 2 layers): the encoder over an 8-token prompt once, then the decoder
    (self- and cross-attention) generating 4 tokens."""
    m, cfg = _hf("bart", dict(d_model=64, encoder_layers=2, decoder_layers=2,
                              encoder_attention_heads=4, decoder_attention_heads=4,
                              encoder_ffn_dim=176, decoder_ffn_dim=176, vocab_size=VOCAB,
                              max_position_embeddings=64), "BartForConditionalGeneration")
    ids = _ids(8)
    return {"": m}, lambda: m.generate(ids, max_new_tokens=4, min_new_tokens=4, num_beams=1,
                                       do_sample=False), {"": cfg}


def owlvit() -> tuple[dict[str, nn.Module], Step, dict[str, dict]]:
    """OWL-ViT, an open-vocabulary detector: a CLIP text encoder (causally masked) over two
    8-token queries and a ViT over a 32x32 image (patch 8), both H 64, 2 layers."""
    import transformers

    tower = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4)
    cfg = transformers.OwlViTConfig(
        text_config=dict(tower, vocab_size=VOCAB, max_position_embeddings=16),
        vision_config=dict(tower, image_size=32, patch_size=8), projection_dim=64)
    torch.manual_seed(0)
    m = transformers.OwlViTForObjectDetection(cfg).eval()
    ids, pixels = _ids(8, 2), torch.randn(1, 3, 32, 32)
    return {"": m}, lambda: m(input_ids=ids, pixel_values=pixels), {"": cfg.to_dict()}


# name -> (builder, profiled steps, what it is)
CAPTURES: dict[str, tuple[Callable[[], tuple[dict[str, nn.Module], Step, dict[str, dict]]],
                          int, str]] = {
    "llama_beam4": (beam, 1, "tiny Llama generate(num_beams=4), prompt 8, 4 new tokens"),
    "deepseek_v2_moe": (_prefill("deepseek_v2", DEEPSEEK, "DeepseekV2ForCausalLM"), 2,
                        f"DeepSeek-V2 prefill B={BATCH} T={PROMPT}: 1 dense + 2 MoE layers, "
                        "8 routed experts top-2, 1 shared expert"),
    "deepseek_v3_moe": (_prefill("deepseek_v3", dict(DEEPSEEK, q_lora_rank=40),
                                 "DeepseekV3ForCausalLM"), 2,
                        f"DeepSeek-V3 prefill B={BATCH} T={PROMPT}: 1 dense + 2 MoE layers, "
                        "8 routed experts top-2, 1 shared expert"),
    "gemma3_qk_norm": (_prefill("gemma3_text", GEMMA3, "Gemma3ForCausalLM"), 2,
                       f"Gemma-3 text prefill B={BATCH} T={PROMPT}, per-head q/k RMSNorm"),
    "plain_block": (plain, 2, "PlainLM (nn.Linear q/k/v/out, fc1/fc2, LayerNorm) B=2 T=32"),
    "t5_dit": (t5_dit, 2, "T5 encoder then a DiT-like transformer with adaLN modulation"),
    "vit_encoder": (vit, 2, f"ViTForImageClassification B={BATCH} 32x32 patch 8"),
    "bert_encoder": (bert, 2, f"BertForMaskedLM B={BATCH} T={PROMPT}"),
    "videomae_encoder": (videomae, 2, f"VideoMAEForVideoClassification B={BATCH} 4x32x32"),
    "llama_train": (train, 1, f"tiny Llama train step B={BATCH} T={PROMPT}: loss, backward, "
                    "AdamW"),
    "owlvit_detector": (owlvit, 2, "OWL-ViT open-vocabulary detection: CLIP text encoder over "
                        "2 queries of 8 tokens, ViT over a 32x32 image"),
    "bart_generate": (bart_generate, 1, "BART encoder over 8 tokens, then its decoder "
                      "generating 4 tokens"),
    "llama_assisted": (assisted, 1, "tiny Llama generate with a tinier Llama draft, prompt 8, "
                       "6 new tokens"),
}


def capture(name: str, out: Path) -> Path:
    """Profile capture `name`; write its trace (and its models' configs) under `out`."""
    build, steps, what = CAPTURES[name]
    models, step, configs = build()
    grad = torch.enable_grad() if name == "llama_train" else torch.no_grad()
    with grad:
        step()  # warm-up
        workload = _workload(name)  # (imports transformers outside the profiler)
        modules = _module_names(models)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    record_shapes=True, with_stack=True,
                                    with_modules=True) as prof:
            for i in range(steps):
                with torch.profiler.record_function(f"ProfilerStep#{i}"):
                    step()
            modules.remove()
            prof.add_metadata_json("trace_roofline_workload", json.dumps(workload))
            prof.add_metadata_json("trace_roofline_modules", json.dumps(modules.names))
    out.mkdir(parents=True, exist_ok=True)
    raw = out / f"{name}_cpu.json"
    prof.export_chrome_trace(str(raw))
    path = out / f"{name}_cpu.json.gz"
    path.write_bytes(gzip.compress(raw.read_bytes(), mtime=0))
    raw.unlink()
    for suffix, cfg in configs.items():
        stem = f"{name}_{suffix}" if suffix else name
        (out / f"{stem}.config.json").write_text(json.dumps(cfg, indent=1, sort_keys=True,
                                                            default=str) + "\n")
    return path


def _workload(name: str) -> dict[str, object]:
    """The capture's description: what ran, on what."""
    import transformers

    _, steps, what = CAPTURES[name]
    return dict(name=name, what=what, steps=steps, dtype="float32", device="cpu",
                torch=torch.__version__, transformers=transformers.__version__,
                cpu=_cpu(), threads=torch.get_num_threads())


def _cpu() -> str:
    """The CPU's model name (Linux), else the machine type."""
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")),
                platform.machine())


class _module_names:
    """While alive, records each module's first call: the profiler's name for it
    (`<class>_<n>`, n counting that class's instances in order of first call) -> its
    qualified name (prefixed by its model's key in `models`)."""

    def __init__(self, models: dict[str, nn.Module]) -> None:
        self.qualified = {id(m): ".".join(p for p in (key, q) if p)
                          for key, model in models.items()
                          for q, m in model.named_modules()}
        self.names: dict[str, str] = {}
        self.seen: set[int] = set()
        self.count: dict[str, int] = defaultdict(int)
        self.handle = nn.modules.module.register_module_forward_pre_hook(self.hook)

    def hook(self, module: nn.Module, _args: object) -> None:
        if id(module) in self.seen:
            return
        self.seen.add(id(module))
        cls = type(module).__name__
        self.names[f"{cls}_{self.count[cls]}"] = self.qualified.get(id(module), "")
        self.count[cls] += 1

    def remove(self) -> None:
        self.handle.remove()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("sample_traces/misleading"))
    ap.add_argument("--only", default=",".join(CAPTURES), help="captures, comma separated")
    a = ap.parse_args(argv)
    torch.set_num_threads(2)
    for name in a.only.split(","):
        path = capture(name, a.out)
        print(f"wrote {path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
