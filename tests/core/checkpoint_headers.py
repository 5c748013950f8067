"""Key names and shapes of real checkpoints (SD1.5, SDXL all-in-one; Flux.1-dev), for header-only files.

Each function returns ``{key: (dtype, shape)}`` as the original checkpoints hold them: the LDM
UNet (``model.diffusion_model.``), the text encoders (SD1.5's CLIP-L under ``cond_stage_model.``;
SDXL's CLIP-L and OpenCLIP-G under ``conditioner.embedders.0/1.``) and the KL VAE
(``first_stage_model.``). The channel bookkeeping follows the LDM ``UNetModel`` constructor, so
block counts and sizes are the real ones (an SD1.5 fp16 UNet is 1.6 GiB, SDXL's 4.8 GiB).
``flux_dev`` is the released ``flux1-dev.safetensors`` (bf16, no prefix): every key and shape, as
ComfyUI's own Flux class builds them at that configuration (checked by a test against the host).
"""
from __future__ import annotations


def _norm(e, k, c, dt):
    e[f"{k}.weight"] = (dt, [c])
    e[f"{k}.bias"] = (dt, [c])


def _lin(e, k, o, i, dt, bias=True):
    e[f"{k}.weight"] = (dt, [o, i])
    if bias:
        e[f"{k}.bias"] = (dt, [o])


def _conv(e, k, o, i, ks, dt):
    e[f"{k}.weight"] = (dt, [o, i, ks, ks])
    e[f"{k}.bias"] = (dt, [o])


def _resblock(e, k, cin, cout, emb, dt):
    _norm(e, f"{k}.in_layers.0", cin, dt)
    _conv(e, f"{k}.in_layers.2", cout, cin, 3, dt)
    _lin(e, f"{k}.emb_layers.1", cout, emb, dt)
    _norm(e, f"{k}.out_layers.0", cout, dt)
    _conv(e, f"{k}.out_layers.3", cout, cout, 3, dt)
    if cin != cout:
        _conv(e, f"{k}.skip_connection", cout, cin, 1, dt)


def _transformer(e, k, c, depth, ctx, linear, dt):
    _norm(e, f"{k}.norm", c, dt)
    proj = (lambda kk: _lin(e, kk, c, c, dt)) if linear else (lambda kk: _conv(e, kk, c, c, 1, dt))
    proj(f"{k}.proj_in")
    for d in range(depth):
        b = f"{k}.transformer_blocks.{d}"
        for att, kv in (("attn1", c), ("attn2", ctx)):
            _lin(e, f"{b}.{att}.to_q", c, c, dt, bias=False)
            _lin(e, f"{b}.{att}.to_k", c, kv, dt, bias=False)
            _lin(e, f"{b}.{att}.to_v", c, kv, dt, bias=False)
            _lin(e, f"{b}.{att}.to_out.0", c, c, dt)
        _lin(e, f"{b}.ff.net.0.proj", 8 * c, c, dt)
        _lin(e, f"{b}.ff.net.2", c, 4 * c, dt)
        for n in ("norm1", "norm2", "norm3"):
            _norm(e, f"{b}.{n}", c, dt)
    proj(f"{k}.proj_out")


def unet(prefix, mult, depths, middle_depth, ctx, linear, adm=None, mc=320, nres=2, dt="F16"):
    """The LDM UNet's keys: ``depths[level]`` transformer blocks per attention (0: none)."""
    e: dict = {}
    emb = 4 * mc
    _lin(e, f"{prefix}time_embed.0", emb, mc, dt)
    _lin(e, f"{prefix}time_embed.2", emb, emb, dt)
    if adm:
        _lin(e, f"{prefix}label_emb.0.0", emb, adm, dt)
        _lin(e, f"{prefix}label_emb.0.2", emb, emb, dt)
    _conv(e, f"{prefix}input_blocks.0.0", mc, 4, 3, dt)
    chans, ch, ib = [mc], mc, 1
    for level, m in enumerate(mult):
        for _ in range(nres):
            _resblock(e, f"{prefix}input_blocks.{ib}.0", ch, m * mc, emb, dt)
            ch = m * mc
            if depths[level]:
                _transformer(e, f"{prefix}input_blocks.{ib}.1", ch, depths[level], ctx, linear, dt)
            chans.append(ch)
            ib += 1
        if level != len(mult) - 1:
            _conv(e, f"{prefix}input_blocks.{ib}.0.op", ch, ch, 3, dt)
            chans.append(ch)
            ib += 1
    _resblock(e, f"{prefix}middle_block.0", ch, ch, emb, dt)
    _transformer(e, f"{prefix}middle_block.1", ch, middle_depth, ctx, linear, dt)
    _resblock(e, f"{prefix}middle_block.2", ch, ch, emb, dt)
    ob = 0
    for level, m in reversed(list(enumerate(mult))):
        for i in range(nres + 1):
            _resblock(e, f"{prefix}output_blocks.{ob}.0", ch + chans.pop(), m * mc, emb, dt)
            ch = m * mc
            j = 1
            if depths[level]:
                _transformer(e, f"{prefix}output_blocks.{ob}.1", ch, depths[level], ctx, linear, dt)
                j = 2
            if level and i == nres:
                _conv(e, f"{prefix}output_blocks.{ob}.{j}.conv", ch, ch, 3, dt)
            ob += 1
    _norm(e, f"{prefix}out.0", ch, dt)
    _conv(e, f"{prefix}out.2", 4, ch, 3, dt)
    return e


def clip_l(prefix, dt="F16", d=768, layers=12):
    """HF ``CLIPTextModel`` keys (``transformer.text_model.*``)."""
    e: dict = {}
    t = f"{prefix}transformer.text_model."
    e[f"{t}embeddings.token_embedding.weight"] = (dt, [49408, d])
    e[f"{t}embeddings.position_embedding.weight"] = (dt, [77, d])
    for i in range(layers):
        k = f"{t}encoder.layers.{i}"
        for p in ("q_proj", "k_proj", "v_proj", "out_proj"):
            _lin(e, f"{k}.self_attn.{p}", d, d, dt)
        _norm(e, f"{k}.layer_norm1", d, dt)
        _norm(e, f"{k}.layer_norm2", d, dt)
        _lin(e, f"{k}.mlp.fc1", 4 * d, d, dt)
        _lin(e, f"{k}.mlp.fc2", d, 4 * d, dt)
    _norm(e, f"{t}final_layer_norm", d, dt)
    return e


def open_clip_g(prefix, dt="F16", d=1280, layers=32):
    """OpenCLIP ViT-bigG text tower keys (``model.transformer.resblocks.*``), as SDXL holds it."""
    e: dict = {}
    m = f"{prefix}model."
    e[f"{m}positional_embedding"] = (dt, [77, d])
    e[f"{m}token_embedding.weight"] = (dt, [49408, d])
    e[f"{m}text_projection"] = (dt, [d, d])
    e[f"{m}logit_scale"] = (dt, [])
    for i in range(layers):
        k = f"{m}transformer.resblocks.{i}"
        e[f"{k}.attn.in_proj_weight"] = (dt, [3 * d, d])
        e[f"{k}.attn.in_proj_bias"] = (dt, [3 * d])
        _lin(e, f"{k}.attn.out_proj", d, d, dt)
        _norm(e, f"{k}.ln_1", d, dt)
        _norm(e, f"{k}.ln_2", d, dt)
        _lin(e, f"{k}.mlp.c_fc", 4 * d, d, dt)
        _lin(e, f"{k}.mlp.c_proj", d, 4 * d, dt)
    _norm(e, f"{m}ln_final", d, dt)
    return e


def _vae_res(e, k, cin, cout, dt):
    _norm(e, f"{k}.norm1", cin, dt)
    _conv(e, f"{k}.conv1", cout, cin, 3, dt)
    _norm(e, f"{k}.norm2", cout, dt)
    _conv(e, f"{k}.conv2", cout, cout, 3, dt)
    if cin != cout:
        _conv(e, f"{k}.nin_shortcut", cout, cin, 1, dt)


def _vae_mid(e, k, c, dt):
    _vae_res(e, f"{k}.block_1", c, c, dt)
    _norm(e, f"{k}.attn_1.norm", c, dt)
    for p in ("q", "k", "v", "proj_out"):
        _conv(e, f"{k}.attn_1.{p}", c, c, 1, dt)
    _vae_res(e, f"{k}.block_2", c, c, dt)


def kl_vae(prefix, dt="F16", ch=128, mult=(1, 2, 4, 4), z=4):
    """The LDM ``AutoencoderKL`` keys (``encoder.down.*``, ``decoder.up.*``)."""
    e: dict = {}
    _conv(e, f"{prefix}encoder.conv_in", ch, 3, 3, dt)
    cin = ch
    for i, m in enumerate(mult):
        for b in range(2):
            _vae_res(e, f"{prefix}encoder.down.{i}.block.{b}", cin, ch * m, dt)
            cin = ch * m
        if i != len(mult) - 1:
            _conv(e, f"{prefix}encoder.down.{i}.downsample.conv", cin, cin, 3, dt)
    _vae_mid(e, f"{prefix}encoder.mid", cin, dt)
    _norm(e, f"{prefix}encoder.norm_out", cin, dt)
    _conv(e, f"{prefix}encoder.conv_out", 2 * z, cin, 3, dt)
    _conv(e, f"{prefix}quant_conv", 2 * z, 2 * z, 1, dt)
    _conv(e, f"{prefix}post_quant_conv", z, z, 1, dt)
    top = ch * mult[-1]
    _conv(e, f"{prefix}decoder.conv_in", top, z, 3, dt)
    _vae_mid(e, f"{prefix}decoder.mid", top, dt)
    cin = top
    for i in reversed(range(len(mult))):
        for b in range(3):
            _vae_res(e, f"{prefix}decoder.up.{i}.block.{b}", cin, ch * mult[i], dt)
            cin = ch * mult[i]
        if i:
            _conv(e, f"{prefix}decoder.up.{i}.upsample.conv", cin, cin, 3, dt)
    _norm(e, f"{prefix}decoder.norm_out", cin, dt)
    _conv(e, f"{prefix}decoder.conv_out", 3, cin, 3, dt)
    return e


def sd15_components() -> dict[str, dict]:
    """SD1.5's all-in-one checkpoint, per component (the file is their union plus ``rest``)."""
    return {
        "MODEL": unet("model.diffusion_model.", (1, 2, 4, 4), (1, 1, 1, 0), 1, 768, linear=False),
        "CLIP": clip_l("cond_stage_model."),
        "VAE": kl_vae("first_stage_model."),
        "rest": {"alphas_cumprod": ("F32", [1000]), "betas": ("F32", [1000]),
                 "alphas_cumprod_prev": ("F32", [1000])},
    }


def sdxl_components() -> dict[str, dict]:
    """SDXL base's all-in-one checkpoint, per component."""
    return {
        "MODEL": unet("model.diffusion_model.", (1, 2, 4), (0, 2, 10), 10, 2048, linear=True, adm=2816),
        "CLIP": clip_l("conditioner.embedders.0.") | open_clip_g("conditioner.embedders.1."),
        "VAE": kl_vae("first_stage_model."),
        "rest": {},
    }


def flux_dev(prefix="", dt="BF16", d=3072, mlp=4, heads=24, n_double=19, n_single=38, ctx=4096, vec=768):
    """Flux.1-dev's transformer: 19 double blocks, 38 single blocks, 11.9 B parameters."""
    e: dict = {}
    head = d // heads
    _lin(e, f"{prefix}img_in", d, 64, dt)
    for emb, i in (("time_in", 256), ("vector_in", vec), ("guidance_in", 256)):
        _lin(e, f"{prefix}{emb}.in_layer", d, i, dt)
        _lin(e, f"{prefix}{emb}.out_layer", d, d, dt)
    _lin(e, f"{prefix}txt_in", d, ctx, dt)
    for i in range(n_double):
        for s in ("img", "txt"):
            k = f"{prefix}double_blocks.{i}.{s}"
            _lin(e, f"{k}_mod.lin", 6 * d, d, dt)
            _lin(e, f"{k}_attn.qkv", 3 * d, d, dt)
            e[f"{k}_attn.norm.query_norm.scale"] = (dt, [head])
            e[f"{k}_attn.norm.key_norm.scale"] = (dt, [head])
            _lin(e, f"{k}_attn.proj", d, d, dt)
            _lin(e, f"{k}_mlp.0", mlp * d, d, dt)
            _lin(e, f"{k}_mlp.2", d, mlp * d, dt)
    for i in range(n_single):
        k = f"{prefix}single_blocks.{i}"
        _lin(e, f"{k}.linear1", 3 * d + mlp * d, d, dt)
        _lin(e, f"{k}.linear2", d, d + mlp * d, dt)
        e[f"{k}.norm.query_norm.scale"] = (dt, [head])
        e[f"{k}.norm.key_norm.scale"] = (dt, [head])
        _lin(e, f"{k}.modulation.lin", 3 * d, d, dt)
    _lin(e, f"{prefix}final_layer.linear", 64, d, dt)
    _lin(e, f"{prefix}final_layer.adaLN_modulation.1", 2 * d, d, dt)
    return e
