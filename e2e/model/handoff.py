#!/usr/bin/env python3
"""A real model's KV cache handed prefill -> decode through kvfabric (issue 13).

A small Llama-architecture causal LM (transformers ``LlamaForCausalLM`` from
a ``LlamaConfig``: 4 layers, hidden 1024, 16 query heads, 4 KV heads (GQA),
head_dim 64, bf16, weights from a fixed seed: nothing is downloaded) serves
synthetic prompts (seeded token ids) three ways:

  * reference (a process of its own): prefill + N greedy decode steps with
    the model's native ``DynamicCache``; the logits of every step are kept;
  * prefill engine (attached to agent "node-a", role prefill): runs the same
    prefill, writes every layer's K and V into its paged KV pool (one flat
    uint8 tensor laid out as ``kvfabric.Layout``: layer-major, planes K then
    V, blocks of 16 tokens ``[tokens][kv_heads][head_dim]``, block ids from
    a shuffled free list, so never contiguous), takes the first greedy token
    from the prefill logits and asks its agent to hand each request's blocks
    to the decode engine (``transfer_blocks``, bounce path for GPU pools);
  * decode engine (attached to agent "node-b", role decode): allocates the
    request's blocks first and gives their ids to the prefill engine the way
    a router would (a file in the run's work folder), awaits arrival,
    gathers its blocks back into a ``DynamicCache`` and decodes N greedy
    steps from the first token the router passed on.

The decode engine's logits must be bit-identical (``torch.equal``) to the
reference's at every step, and its tokens identical. Cases: single prompts
(517, 2048, 8000 tokens) and batches: a batch of mixed lengths (left padded,
attention mask, position ids from the mask) and one of equal lengths. A
batch is prefilled as a batch in both runs (the same composition, padding
and mask), every request of it is handed off separately (concurrently), and
the decode engine decodes it as a batch; the pad positions of the rebuilt
cache are zeros (they are masked, so they contribute exactly 0). A
negative control hands one more request off and flips one byte of one
arrived block in the decode pool before the rebuild: its logits must
differ, so the check can fail. Every case runs with each attention
implementation of ``--attn`` (default eager and sdpa).

SDPA cases are pinned to one backend (``--sdpa-backend``, default
efficient on CUDA, math on the CPU; ``torch.nn.attention.sdpa_kernel`` with
that backend alone, the same in every process; where it takes no
``enable_gqa`` the KV heads are repeated first, in every process alike).
Unpinned, PyTorch 2.11 with CUDA 13 and cuDNN >= 9.15.1 prefers cuDNN
attention on sm90 (H200), which it calls not deterministic and which
``use_deterministic_algorithms(True, warn_only=True)`` leaves eligible; the
first H200 run (unpinned) had two of four requests of the equal batch
differ by one bf16 ulp at steps 11 and 62 with every KV digest equal.
``--sdpa-backend default`` keeps that unpinned run; a comma-separated list
runs the sdpa cases once per backend (cases ``sdpa-<backend>-...``). Every
SDPA call's backend is counted per case and process
(``torch._fused_sdp_choice``: ``sdpa_dispatch``).

Controls that tell compute nondeterminism from a hand-off difference:
the reference runs every case twice in its process and once more in a
second reference process running at the same time
(``reference_self_identical``, ``reference_control``), and the memory
layout of the native cache after the prefill (reference and prefill
engine) is compared with the rebuilt one (dtype, shape, strides, storage
offset, contiguity, storage size, pointer alignment, inference tensor:
``cache_layout``, ``cache_layout_identical``); ``diagnosis`` says which
applies when a case differs.

Besides the logits, sha256 digests of each request's KV (token-major) are
compared: the reference's cache, the prefill engine's cache and pool, the
decode engine's pool after arrival (so a mismatch says whether the bytes or
the compute differed), and the weights' digests of the three processes.
Each request is handed off ``--repeats`` more times (same blocks, awaited
by the decode engine before it reads them) and each prefill run as many
more times, for p50/p99 of the hand-off beside the prefill compute time.

Writes a JSON report (``--out``): per request the prompt tokens, steps,
``bit_identical``, the first mismatching step, bytes handed off, the
transfer's path, submit_us / transfer_us (and p50/p99 over the repeats),
the arrival, the KV digests; per case the prefill compute time; a latency
table per prompt length; both agents' ``/v1/peers`` (the transport report
with ``suspect_fallback``) and ``bounce_effective`` from ``/v1/config``.
The run's work folder (logs, logits files) is named in the report. Exit
status 0 when every check passed.

Usage (repo root, on the GPU machine):
  python3 e2e/model/handoff.py --bin BIN --etcd ETCD --out OUT.json
  (add --sdpa-backend efficient,default for the unpinned default backend
  beside the pinned one, as a diagnostic: ``ok`` leaves it out, ``ok_all``
  has it)

Without a GPU, through real agents with host (POSIX shm) pools:
  python3 e2e/model/handoff.py --bin BIN --etcd ETCD --out OUT.json \\
      --host-pools --device cpu --cases '100;300;100,300' --steps 8 --layers 2
Without agents (the fabric replaced by a pure-torch block copy between two
pools; tests the model and paging code alone):
  python3 e2e/model/handoff.py --local --device cpu --out OUT.json \\
      --cases '100;300;100,300' --steps 8 --layers 2
"""

import argparse
import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "agent", "python"))

# cuBLAS is deterministic for a fixed configuration; this workspace setting
# makes it so under torch.use_deterministic_algorithms as well. Set before
# torch loads (every process of this script imports torch lazily).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

BLOCK_TOKENS = 16
PAD_ID = 0
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


# --------------------------------------------------------------------------
# plan: the same in every process (derived from the arguments only)


def parse_cases(spec):
    """'517;2048;1000,3000' -> [[517], [2048], [1000, 3000]]."""
    cases = []
    for part in spec.split(";"):
        part = part.strip()
        if not part:
            continue
        lens = []
        for x in part.split(","):
            x = x.strip()
            if "x" in x:  # 1024x4
                n, k = x.split("x")
                lens += [int(n)] * int(k)
            else:
                lens.append(int(x))
        cases.append(lens)
    return cases


SDPA_BACKENDS = ("default", "math", "efficient", "flash", "cudnn")


def resolve_sdpa_backends(spec, device):
    """--sdpa-backend: 'auto' is efficient on CUDA (a fused kernel whose
    forward is deterministic) and math on the CPU (which has no efficient
    kernel)."""
    out = []
    for b in spec.split(","):
        b = b.strip()
        if b == "auto":
            b = "efficient" if device.startswith("cuda") else "math"
        if b not in SDPA_BACKENDS:
            raise ValueError(f"--sdpa-backend: {b!r} is none of auto, {', '.join(SDPA_BACKENDS)}")
        if b in ("efficient", "cudnn") and not device.startswith("cuda"):
            raise ValueError(f"--sdpa-backend: {b} needs CUDA (the CPU has math and flash)")
        if b not in out:
            out.append(b)
    return out


def attn_variants(a):
    """[(name, attn, sdpa backend)]: eager once, sdpa once per
    --sdpa-backend (name sdpa-<backend>); the backend is None for eager."""
    out = []
    for attn in a.attn.split(","):
        attn = attn.strip()
        if attn == "sdpa":
            out += [(f"sdpa-{b}", "sdpa", b) for b in a.sdpa_backend.split(",")]
        else:
            out.append((attn, attn, None))
    return out


def plan(a):
    """Cases: name, attention implementation (and SDPA backend), prompt
    lengths, request ids, prompt seeds, whether this is the negative
    control."""
    out = []
    cases = parse_cases(a.cases)
    for ai, (vname, attn, backend) in enumerate(attn_variants(a)):
        for ci, lens in enumerate(cases):
            kind = "single" if len(lens) == 1 else "batch"
            name = f"{vname}-{kind}-{'+'.join(map(str, lens))}"
            out.append(dict(key=name, variant=vname, attn=attn, backend=backend, lens=lens, negative=False,
                            rids=[(ai * 100 + ci) * 100 + i + 1 for i in range(len(lens))],
                            seeds=[a.seed * 1000003 + ci * 101 + i for i in range(len(lens))]))
        if a.negative_control:
            lens = [cases[0][0]]
            out.append(dict(key=f"{vname}-negative-{lens[0]}", variant=vname, attn=attn, backend=backend, lens=lens,
                            negative=True, rids=[(ai * 100 + 99) * 100 + 1],
                            seeds=[a.seed * 1000003 + 0]))  # the first single prompt again
    return out


def blocks_needed(lens):
    return sum((n + BLOCK_TOKENS - 1) // BLOCK_TOKENS for n in lens)


def pool_blocks(a):
    if a.num_blocks:
        return a.num_blocks
    need = max(blocks_needed(c["lens"]) for c in plan(a))
    return 2 * need + 16  # room to scatter the allocation


class BlockAllocator:
    """A serving engine's free list: shuffled (seeded), so a request's
    blocks are scattered over the pool."""

    def __init__(self, num_blocks, seed):
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def alloc(self, n):
        if n > len(self.free):
            raise RuntimeError(f"pool exhausted: {n} blocks wanted, {len(self.free)} free")
        got, self.free = self.free[:n], self.free[n:]
        return got

    def release(self, blocks):
        self.free.extend(blocks)


# --------------------------------------------------------------------------
# model


def setup_torch(a):
    """Deterministic algorithms (warn_only: an op without a deterministic
    implementation warns instead of failing; note that under warn_only
    PyTorch keeps cuDNN attention eligible for SDPA, which it calls not
    deterministic and, with CUDA 13 wheels and cuDNN >= 9.15.1, prefers on
    sm90/sm100: hence --sdpa-backend), no TF32, the SDPA hooks."""
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)
    if a.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    install_sdpa_hooks()
    return torch


# SDPA: the backend a case is pinned to, which backend every call took.
_SDPA = {"tally": None, "repeat_kv": False, "gqa": {}}


def install_sdpa_hooks():
    """Two wrappers, installed once per process:

    * ``torch.nn.functional.scaled_dot_product_attention`` (transformers
      looks it up at every call): counts, per case, which backend each call
      dispatches to, as ``torch._fused_sdp_choice`` (the dispatcher's own
      choice under the active ``sdpa_kernel`` setting) says, keyed
      ``prefill|decode:<backend>[:gqa]``;
    * transformers' ``use_gqa_in_sdpa``: False while the pinned backend
      cannot take ``enable_gqa`` (then transformers repeats the KV heads
      itself, as it does whenever a mask is passed)."""
    import torch
    import torch.nn.functional as F

    if getattr(F.scaled_dot_product_attention, "_kvf_wrapped", False):
        return
    from torch.nn.attention import SDPBackend

    names = {(v.value if hasattr(v, "value") else int(v)): k.lower() for k, v in SDPBackend.__members__.items()}
    orig = F.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
             **kw):
        t = _SDPA["tally"]
        if t is not None:
            try:
                c = int(torch._fused_sdp_choice(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                                enable_gqa=enable_gqa))
                name = names.get(c, str(c))
            except Exception:  # noqa: BLE001 - a count, never a failure
                name = "unknown"
            k = ("prefill" if query.shape[-2] > 1 else "decode") + ":" + name + (":gqa" if enable_gqa else "") + \
                (":mask" if attn_mask is not None else "")
            t[k] = t.get(k, 0) + 1
        return orig(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa, **kw)

    sdpa._kvf_wrapped = True
    F.scaled_dot_product_attention = sdpa
    try:
        import transformers.integrations.sdpa_attention as ta

        orig_gqa = ta.use_gqa_in_sdpa

        def use_gqa_in_sdpa(attention_mask, key, value):
            return False if _SDPA["repeat_kv"] else orig_gqa(attention_mask, key, value)

        ta.use_gqa_in_sdpa = use_gqa_in_sdpa
    except Exception:  # noqa: BLE001 - an older transformers: repeats KV heads itself
        pass


def sdpa_backend_enum(name):
    from torch.nn.attention import SDPBackend

    return {"math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[name]


def sdpa_gqa(a, backend):
    """Whether ``backend`` takes ``enable_gqa`` (a probe on the model's
    head shapes, decode and prefill, cached): 'enable_gqa' or 'repeat_kv'
    (then the KV heads are repeated before SDPA, in every process alike)."""
    import torch

    if backend not in _SDPA["gqa"]:
        from torch.nn.attention import sdpa_kernel

        dt = getattr(torch, DTYPES[a.dtype])
        mode = "enable_gqa"
        tally, _SDPA["tally"] = _SDPA["tally"], None  # the probe is no model call
        try:
            with sdpa_kernel([sdpa_backend_enum(backend)]):
                for sq, causal in ((1, False), (32, True)):
                    q = torch.zeros((1, a.heads, sq, a.head_dim), dtype=dt, device=a.device)
                    kv = torch.zeros((1, a.kv_heads, 32, a.head_dim), dtype=dt, device=a.device)
                    torch.nn.functional.scaled_dot_product_attention(q, kv, kv, is_causal=causal, enable_gqa=True)
        except RuntimeError:
            mode = "repeat_kv"
        finally:
            _SDPA["tally"] = tally
        _SDPA["gqa"][backend] = mode
    return _SDPA["gqa"][backend]


@contextlib.contextmanager
def attn_ctx(a, case):
    """The SDPA setting of a case, the same in every process: for a pinned
    backend ``sdpa_kernel([backend])`` (only that backend may run: no
    silent fallback), and repeated KV heads where it has no GQA; for
    'default' and eager nothing (PyTorch's own choice)."""
    backend = case.get("backend")
    if case["attn"] != "sdpa" or backend in (None, "default"):
        yield
        return
    from torch.nn.attention import sdpa_kernel

    _SDPA["repeat_kv"] = sdpa_gqa(a, backend) == "repeat_kv"
    try:
        with sdpa_kernel([sdpa_backend_enum(backend)]):
            yield
    finally:
        _SDPA["repeat_kv"] = False


def tally_start():
    _SDPA["tally"] = {}


def tally_take():
    t, _SDPA["tally"] = _SDPA["tally"], None
    return dict(sorted((t or {}).items()))


def device_desc(a):
    """Versions and the accelerator, for the report."""
    import torch

    d = {"torch": torch.__version__, "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
         "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
         "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}
    try:
        import transformers

        d["transformers"] = transformers.__version__
    except Exception:  # noqa: BLE001
        pass
    if a.device.startswith("cuda"):
        p = torch.cuda.get_device_properties(torch.device(a.device))
        d.update(gpu=p.name, capability=f"{p.major}.{p.minor}", cuda=torch.version.cuda,
                 cudnn=torch.backends.cudnn.version())
    return d


def build_model(a, attn):
    """The model: constructed on the CPU in fp32 right after
    torch.manual_seed (CPU initialisation is the same in every process and
    on every machine), cast to the run's dtype, then moved to the device.
    Returns (model, sha256 of every parameter's bytes)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
        num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
        head_dim=a.head_dim, max_position_embeddings=a.max_positions, rms_norm_eps=1e-5,
        tie_word_embeddings=False, pad_token_id=PAD_ID, attn_implementation=attn,
    )
    torch.manual_seed(a.seed)
    model = LlamaForCausalLM(cfg)
    model = model.to(getattr(torch, DTYPES[a.dtype])).eval()
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.contiguous().view(torch.uint8).numpy().tobytes())
    model = model.to(a.device)
    assert model.config._attn_implementation == attn, model.config._attn_implementation
    return model, h.hexdigest()[:16]


def prompts(a, case):
    """Left-padded input ids and mask [B, P] (on the device) for a case."""
    import torch

    P = max(case["lens"])
    B = len(case["lens"])
    ids = torch.full((B, P), PAD_ID, dtype=torch.long)
    mask = torch.zeros((B, P), dtype=torch.long)
    for i, (n, seed) in enumerate(zip(case["lens"], case["seeds"])):
        g = torch.Generator().manual_seed(seed)
        ids[i, P - n:] = torch.randint(1, a.vocab, (n,), generator=g)
        mask[i, P - n:] = 1
    return ids.to(a.device), mask.to(a.device)


def prefill(model, ids, mask):
    """Prefill: returns (cache, last-position logits [B, V], first greedy
    tokens [B])."""
    import torch
    from transformers import DynamicCache

    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                    use_cache=True, logits_to_keep=1)
    logits = out.logits[:, -1, :]
    return out.past_key_values, logits, logits.argmax(-1)


def decode(model, cache, mask, lens, first, steps):
    """Greedy decode ``steps`` steps from tokens ``first`` [B]: returns the
    logits [B, steps, V] of every step and the tokens [B, steps + 1]
    (``first`` included)."""
    import torch

    B = first.shape[0]
    tok = first.view(B, 1)
    lens_t = torch.tensor(lens, dtype=torch.long, device=mask.device).view(B, 1)
    logits, toks = [], [tok]
    with torch.inference_mode():
        for t in range(steps):
            mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device=mask.device)], dim=1)
            out = model(input_ids=tok, attention_mask=mask, position_ids=lens_t + t,
                        past_key_values=cache, use_cache=True)
            lg = out.logits[:, -1, :]
            logits.append(lg)
            tok = lg.argmax(-1, keepdim=True)
            toks.append(tok)
    return torch.stack(logits, 1), torch.cat(toks, 1)


def cache_layers(cache):
    """[(keys, values)] per layer, each [B, kv_heads, seq, head_dim]
    (transformers 5: ``cache.layers[i].keys`` / ``.values``)."""
    if hasattr(cache, "layers"):
        return [(l.keys, l.values) for l in cache.layers]
    return [(cache.key_cache[i], cache.value_cache[i]) for i in range(len(cache.key_cache))]  # 4.x


def cache_from_layers(model, kv):
    """A DynamicCache holding ``kv`` [(keys, values)] per layer, filled the
    way the model fills it in a prefill: ``update`` per layer under
    ``inference_mode`` (transformers 5's DynamicLayer.update is
    ``torch.cat([empty, states], -2)``, so each layer's keys and values are
    a fresh contiguous tensor of their own: storage offset 0, storage the
    tensor's size, caching-allocator alignment; inference tensors, as the
    native ones are). ``cache_layout`` records both sides."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        for i, (k, v) in enumerate(kv):
            cache.update(k, v, i)
    return cache


def cache_layout(cache):
    """The memory layout of a cache's tensors, per layer K then V: dtype,
    shape, strides, storage offset, contiguity, storage bytes (and whether
    the tensor is a view into a larger storage), pointer alignment (lowest
    set bit, capped at 4096), inference tensor or not."""
    rows = []
    for k, v in cache_layers(cache):
        for t in (k, v):
            ptr = t.data_ptr()
            sb = t.untyped_storage().nbytes()
            rows.append({"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape),
                         "stride": list(t.stride()), "storage_offset": t.storage_offset(),
                         "contiguous": t.is_contiguous(), "storage_bytes": sb,
                         "view_of_larger": sb != t.numel() * t.element_size(),
                         "align_bytes": min(ptr & -ptr, 4096) if ptr else 0, "inference": t.is_inference()})
    return rows


def layout_key(rows):
    """What must match between two caches: everything but the pointer,
    whose alignment is compared up to 64 bytes (more than any kernel's
    vector loads need; the CUDA caching allocator gives >= 512, the CPU
    allocator 64)."""
    return [dict(r, align_bytes=min(r["align_bytes"], 64)) for r in rows]


def layout_summary(rows):
    """The distinct layouts of a cache, K and V apart (layers alike fold
    into one entry with a count)."""
    out = []
    for i, r in enumerate(rows):
        key = dict(r, plane="KV"[i % 2])
        al = key.pop("align_bytes")
        for x in out:
            if x["layout"] == key:
                x["layers"] += 1
                x["align_bytes_min"] = min(x["align_bytes_min"], al)
                break
        else:
            out.append({"layout": key, "layers": 1, "align_bytes_min": al})
    return [dict(x["layout"], layers=x["layers"], align_bytes_min=x["align_bytes_min"]) for x in out]


# --------------------------------------------------------------------------
# the paged pool


class PagedPool:
    """An engine's paged KV pool: ``raw`` is one flat uint8 tensor laid out
    as kvfabric.Layout (layer-major, planes K then V, block =
    [block_tokens][kv_heads][head_dim] of the dtype)."""

    def __init__(self, raw, layers, num_blocks, kv_heads, head_dim, dtype):
        import torch

        self.raw = raw
        self.layers, self.num_blocks, self.kv_heads, self.head_dim = layers, num_blocks, kv_heads, head_dim
        self.dtype = getattr(torch, DTYPES[dtype])
        self.elem = torch.tensor([], dtype=self.dtype).element_size()
        self.block_bytes = BLOCK_TOKENS * kv_heads * head_dim * self.elem
        assert raw.dtype == torch.uint8 and raw.numel() == self.pool_bytes(), (raw.numel(), self.pool_bytes())
        self.view = raw.view(self.dtype).view(layers, 2, num_blocks, BLOCK_TOKENS, kv_heads, head_dim)
        # The typed view must be the byte layout the agent moves.
        for (l, p, b) in ((0, 0, 0), (layers - 1, 1, num_blocks - 1), (layers // 2, 1, num_blocks // 3)):
            got = self.view[l, p, b].data_ptr() - raw.data_ptr()
            assert got == self.block_offset(l, p, b), (l, p, b, got)

    def pool_bytes(self):
        return self.layers * 2 * self.num_blocks * self.block_bytes

    def block_offset(self, layer, plane, block):
        """kvfabric.Layout.block_offset (layout.py), restated so --local
        needs no kvfabric."""
        return ((layer * 2 + plane) * self.num_blocks + block) * self.block_bytes

    def write(self, kv, row, pad, n, blocks):
        """Writes tokens ``pad .. pad+n`` of batch row ``row`` of the cache
        ``kv`` ([(keys, values)], [B, kv_heads, seq, head_dim]) into
        ``blocks``, token-major; the tail of the last block is zero."""
        import torch

        idx = torch.tensor(blocks, dtype=torch.long, device=self.raw.device)
        nb = len(blocks)
        for layer, (k, v) in enumerate(kv):
            for plane, t in ((0, k), (1, v)):
                x = t[row, :, pad:pad + n, :].permute(1, 0, 2)  # [n, heads, dim]
                buf = torch.zeros((nb * BLOCK_TOKENS, self.kv_heads, self.head_dim), dtype=self.dtype,
                                  device=self.raw.device)
                buf[:n] = x
                self.view[layer, plane][idx] = buf.view(nb, BLOCK_TOKENS, self.kv_heads, self.head_dim)

    def read(self, blocks, n):
        """The first ``n`` tokens of ``blocks``: [(keys, values)] per layer,
        each [kv_heads, n, head_dim] (contiguous)."""
        import torch

        idx = torch.tensor(blocks, dtype=torch.long, device=self.raw.device)
        out = []
        for layer in range(self.layers):
            kv = []
            for plane in range(2):
                x = self.view[layer, plane].index_select(0, idx)  # [nb, tokens, heads, dim]
                x = x.reshape(len(blocks) * BLOCK_TOKENS, self.kv_heads, self.head_dim)[:n]
                kv.append(x.permute(1, 0, 2).contiguous())
            out.append(tuple(kv))
        return out

    def corrupt(self, block):
        """Negative control: flips the top exponent bit of the first V
        element of layer 0 of ``block`` (byte 1 of the block: bf16/fp16 are
        little-endian). Returns the byte offset."""
        off = self.block_offset(0, 1, block) + self.elem - 1
        self.raw[off] ^= 0x40
        return off


def rebuild(model, pool, case, dst_blocks):
    """The decode engine's cache for a case from its pool: per layer
    [B, kv_heads, P, head_dim], request i's tokens at P - len_i .. P (left
    padded as the prefill was; pad positions are zeros, masked). The
    staging tensors are dropped once ``cache_from_layers`` has copied them
    into the layout a native prefill leaves."""
    import torch

    lens = case["lens"]
    B, P = len(lens), max(lens)
    dev = next(model.parameters()).device
    kv = [[torch.zeros((B, pool.kv_heads, P, pool.head_dim), dtype=pool.dtype, device=dev)
           for _ in range(2)] for _ in range(pool.layers)]
    for i, (n, blocks) in enumerate(zip(lens, dst_blocks)):
        for layer, (k, v) in enumerate(pool.read(blocks, n)):
            kv[layer][0][i, :, P - n:, :] = k
            kv[layer][1][i, :, P - n:, :] = v
    cache = cache_from_layers(model, [tuple(x) for x in kv])
    del kv
    return cache


def fabric_copy(src, dst, src_blocks, dst_blocks):
    """--local's stand-in for the fabric: every (layer, plane) block's bytes,
    src pool offset -> dst pool offset, as the agent's block descriptors
    move them."""
    bb = src.block_bytes
    assert bb == dst.block_bytes
    n = 0
    for layer in range(src.layers):
        for plane in range(2):
            for s, d in zip(src_blocks, dst_blocks):
                so, do = src.block_offset(layer, plane, s), dst.block_offset(layer, plane, d)
                dst.raw[do:do + bb].copy_(src.raw[so:so + bb])
                n += bb
    return n


def sha(t):
    import torch

    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:16]


def kv_digest(kv):
    """sha256 of one request's KV, token-major: ``kv`` [(keys, values)] per
    layer, each [kv_heads, n, head_dim]. The same in the three processes
    when the prefill KV and the bytes handed off are the same."""
    import torch

    h = hashlib.sha256()
    for k, v in kv:
        for t in (k, v):
            h.update(t.permute(1, 0, 2).contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def request_kv(kv, row, pad, n):
    """Request ``row``'s real tokens of a batch cache: [(keys, values)]
    per layer, each [kv_heads, n, head_dim]."""
    return [(k[row, :, pad:pad + n, :], v[row, :, pad:pad + n, :]) for k, v in kv]


def warm_up(a, model, case):
    """One short prefill + decode step under the case's SDPA setting
    (first-call costs out of the timings)."""
    import torch

    ids = torch.randint(1, a.vocab, (1, 64), generator=torch.Generator().manual_seed(7)).to(a.device)
    mask = torch.ones_like(ids)
    with attn_ctx(a, case):
        cache, _, first = prefill(model, ids, mask)
        decode(model, cache, mask, [64], first, 1)
    sync(a)


def sync(a):
    import torch

    if a.device.startswith("cuda"):
        torch.cuda.synchronize()


# --------------------------------------------------------------------------
# the monolithic reference


def reference_run(a, model, case, tally=False):
    """One monolithic run of a case (prefill, then greedy decode on the
    model's native cache) under the case's SDPA setting: logits and tokens
    of every step, the prefill logits, per-request KV digests, the native
    cache's layout after the prefill; with ``tally`` the SDPA backends its
    calls took."""
    import torch

    ids, mask = prompts(a, case)
    lens, P = case["lens"], max(case["lens"])
    if tally:
        tally_start()
    with attn_ctx(a, case):
        cache, pl, first = prefill(model, ids, mask)
        kv = cache_layers(cache)
        nonfinite = int(sum((~torch.isfinite(k)).sum() + (~torch.isfinite(v)).sum() for k, v in kv))
        digests = [kv_digest(request_kv(kv, i, P - n, n)) for i, n in enumerate(lens)]
        layout = cache_layout(cache)
        del kv
        logits, toks = decode(model, cache, mask, lens, first, a.steps)
    sync(a)
    out = {"logits": logits.cpu(), "tokens": toks.cpu(), "prefill_logits": pl.cpu(), "nonfinite_kv": nonfinite,
           "kv_sha256": digests, "layout": layout}
    if tally:
        out["sdpa_dispatch"] = tally_take()
    return out


def self_check(case, r0, r1):
    """Two monolithic runs of a case compared bit for bit (the control
    that tells SDPA's own run-to-run nondeterminism apart from a hand-off
    or cache-layout difference): identical when every step's logits, the
    tokens, the prefill logits and the KV digests are."""
    rows = compare(case, r0, r1)
    reqs = [{"request_id": r["request_id"], "identical": r["bit_identical"] and r["prefill_logits_identical"],
             "first_mismatch_step": r["first_mismatch_step"], "max_abs_diff": r["max_abs_diff"],
             "prefill_logits_identical": r["prefill_logits_identical"]} for r in rows]
    kv_same = r0["kv_sha256"] == r1["kv_sha256"]
    return {"identical": kv_same and all(r["identical"] for r in reqs), "kv_identical": kv_same,
            "requests": reqs}


def counts_for_ok(a, case):
    """Whether a case's outcome enters ``ok``: all do, except the unpinned
    'default' SDPA cases when a pinned backend runs beside them (then they
    are the diagnostic run, reported with ``passed`` and in ``ok_all``)."""
    return not (case.get("backend") == "default" and len(a.sdpa_backend.split(",")) > 1)


def diagnose(case, rows, ref_self_identical, layout_identical):
    """Why a case's hand-off logits differ (or that they do not)."""
    if all(r["bit_identical"] for r in rows):
        return "identical"
    if case["negative"]:
        return "differs (negative control: a flipped byte)"
    if not all(r.get("kv_identical", True) for r in rows):
        return "KV bytes differ"
    if ref_self_identical is False:
        return "SDPA/compute not run-to-run deterministic (the reference differs from itself)"
    if layout_identical is False:
        return "rebuilt cache layout differs from the native one"
    return "differs although the KV bytes, the cache layout and the reference are stable"


# --------------------------------------------------------------------------
# comparison


def compare(case, ref, got, extra=None):
    """Per request of a case: bit-identical logits at every step, tokens,
    first mismatching step."""
    import torch

    rows = []
    for i, n in enumerate(case["lens"]):
        rl, gl = ref["logits"][i], got["logits"][i]
        rt, gt = ref["tokens"][i], got["tokens"][i]
        steps = rl.shape[0]
        first_bad = None
        for s in range(steps):
            if not torch.equal(rl[s], gl[s]) or not torch.equal(rt[: s + 2], gt[: s + 2]):
                first_bad = s
                break
        row = {
            "request_id": case["rids"][i],
            "tokens": n,
            "steps": steps,
            "bit_identical": first_bad is None and torch.equal(rt, gt),
            "tokens_identical": torch.equal(rt, gt),
            "first_mismatch_step": first_bad,
            "prefill_logits_identical": bool(torch.equal(ref["prefill_logits"][i], got["prefill_logits"][i])),
            "first_token": int(gt[0]),
            "max_abs_diff": float((rl.float() - gl.float()).abs().max()),
            "finite": bool(torch.isfinite(gl).all()),
            "logits_sha256": {"reference": sha(rl), "handoff": sha(gl)},
            "decoded_tokens_head": [int(x) for x in gt[:8]],
        }
        if extra:
            row.update(extra[i])
        rows.append(row)
    return rows


def pct(v, p):
    v = sorted(v)
    return v[min(len(v) - 1, int(p * len(v)))] if v else None


# --------------------------------------------------------------------------
# --local: no agents


def run_local(a):
    torch = setup_torch(a)
    cases = plan(a)
    nb = pool_blocks(a)
    report = {"mode": "local", "device": a.device, "dtype": a.dtype, "torch": torch.__version__,
              "model": model_desc(a), "num_blocks": nb, "sdpa_backend": a.sdpa_backend,
              "reference_runs": {"in_process": 2, "instances": a.ref_procs}, "cases": [], "ok": False}
    report["env"] = device_desc(a)
    report["transformers"] = report["env"].get("transformers")
    ok = True
    models = {}
    for case in cases:
        attn = case["attn"]
        if attn not in models:
            # Separate model instances for the roles, as the processes of
            # the agent run have (same seed, same weights): reference(s),
            # prefill, decode.
            models[attn] = [build_model(a, attn) for _ in range(2 + a.ref_procs)]
            fps = {m[1] for m in models[attn]}
            report.setdefault("weights_sha256", {})[attn] = sorted(fps)
            ok &= len(fps) == 1
            pools = [PagedPool(torch.zeros(pool_bytes(a, nb), dtype=torch.uint8, device=a.device),
                               a.layers, nb, a.kv_heads, a.head_dim, a.dtype) for _ in range(2)]
            allocs = [BlockAllocator(nb, a.seed + 1), BlockAllocator(nb, a.seed + 2)]
        (m_pre, _), (m_dec, _) = models[attn][:2]
        m_refs = [m for m, _ in models[attn][2:]]
        ids, mask = prompts(a, case)
        lens, P = case["lens"], max(case["lens"])
        # reference, twice on the first instance, once on each other one
        ref = reference_run(a, m_refs[0], case, tally=True)
        ctl = {"in_process": self_check(case, ref, reference_run(a, m_refs[0], case)),
               "cross_process": [self_check(case, ref, reference_run(a, m, case)) for m in m_refs[1:]]}
        ref_self = ctl["in_process"]["identical"] and all(x["identical"] for x in ctl["cross_process"])
        ref_kv = ref["kv_sha256"]
        # prefill engine
        tally_start()
        with attn_ctx(a, case):
            t0 = time.perf_counter()
            cache, pl2, first2 = prefill(m_pre, ids, mask)
            sync(a)
            prefill_ms = (time.perf_counter() - t0) * 1e3
        pre_tally = tally_take()
        pre_layout = cache_layout(cache)
        kv = cache_layers(cache)
        dst_blocks = [allocs[1].alloc(blocks_needed([n])) for n in lens]  # decode allocates first
        src_blocks = [allocs[0].alloc(blocks_needed([n])) for n in lens]
        extra = []
        for i, n in enumerate(lens):
            pools[0].write(kv, i, P - n, n, src_blocks[i])
            t0 = time.perf_counter()
            moved = fabric_copy(pools[0], pools[1], src_blocks[i], dst_blocks[i])
            us = int((time.perf_counter() - t0) * 1e6)
            d = {"reference": ref_kv[i], "prefill_cache": kv_digest(request_kv(kv, i, P - n, n)),
                 "prefill_pool": kv_digest(pools[0].read(src_blocks[i], n)),
                 "decode_pool": kv_digest(pools[1].read(dst_blocks[i], n))}
            extra.append({"bytes": moved, "path": "local-copy", "transfer_us": us,
                          "blocks": len(src_blocks[i]), "src_blocks_head": src_blocks[i][:6],
                          "dst_blocks_head": dst_blocks[i][:6], "kv_sha256": d,
                          "kv_identical": len(set(d.values())) == 1})
        del cache, kv
        if case["negative"]:
            extra[0]["corrupted_byte"] = pools[1].corrupt(dst_blocks[0][0])
        # decode engine: only its pool and the first tokens
        cache = rebuild(m_dec, pools[1], case, dst_blocks)
        dec_layout = cache_layout(cache)
        tally_start()
        with attn_ctx(a, case):
            logits, toks = decode(m_dec, cache, mask, lens, first2, a.steps)
        dec_tally = tally_take()
        got = {"logits": logits, "tokens": toks, "prefill_logits": pl2}
        rows = compare(case, ref, got, extra)
        for b in src_blocks:
            allocs[0].release(b)
        for b in dst_blocks:
            allocs[1].release(b)
        lay_ok = layout_key(dec_layout) == layout_key(ref["layout"]) == layout_key(pre_layout)
        c = {"case": case["key"], "attn": attn, "sdpa_backend": case["backend"],
             "negative_control": case["negative"], "batch": len(lens),
             "prefill_ms": round(prefill_ms, 3), "reference_self_identical": ref_self, "reference_control": ctl,
             "cache_layout_identical": lay_ok,
             "cache_layout": {"reference_native": layout_summary(ref["layout"]),
                              "prefill_native": layout_summary(pre_layout),
                              "decode_rebuilt": layout_summary(dec_layout)},
             "sdpa_dispatch": {"reference": ref["sdpa_dispatch"], "prefill": pre_tally, "decode": dec_tally},
             "requests": rows}
        c["diagnosis"] = diagnose(case, rows, ref_self, lay_ok)
        kv_ok = all(r["kv_identical"] for r in rows)
        if case["negative"]:
            c["differs_as_expected"] = kv_ok and not any(r["bit_identical"] for r in rows)
            c["passed"] = c["differs_as_expected"]
        else:
            c["passed"] = kv_ok and all(r["bit_identical"] and r["prefill_logits_identical"] for r in rows)
        c["counts_for_ok"] = counts_for_ok(a, case)
        ok &= c["passed"] or not c["counts_for_ok"]
        report["cases"].append(c)
        print(f"{case['key']}: ref_self_identical={ref_self} layout_identical={lay_ok} " + ", ".join(
            f"{r['tokens']} tok bit_identical={r['bit_identical']} first_mismatch={r['first_mismatch_step']}"
            for r in rows), flush=True)
    report["sdpa_gqa"] = dict(_SDPA["gqa"])
    report["reference_self_identical"] = all(c["reference_self_identical"] for c in report["cases"])
    report["ok"] = bool(ok)
    report["ok_all"] = bool(ok and all(c["passed"] for c in report["cases"]))
    return report


def model_desc(a):
    return {"arch": "LlamaForCausalLM", "layers": a.layers, "hidden": a.hidden, "heads": a.heads,
            "kv_heads": a.kv_heads, "head_dim": a.head_dim, "intermediate": a.intermediate,
            "vocab": a.vocab, "dtype": a.dtype, "seed": a.seed, "block_tokens": BLOCK_TOKENS}


def pool_bytes(a, nb):
    import torch

    elem = torch.tensor([], dtype=getattr(torch, DTYPES[a.dtype])).element_size()
    return a.layers * 2 * nb * BLOCK_TOKENS * a.kv_heads * a.head_dim * elem


# --------------------------------------------------------------------------
# the three processes of the agent run


def atomic_write(path, data, binary=False):
    tmp = path + ".tmp"
    with open(tmp, "wb" if binary else "w") as f:
        f.write(data)
    os.replace(tmp, path)


def atomic_torch_save(obj, path):
    import torch

    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def wait_file(path, t, what=""):
    end = time.time() + t
    while time.time() < end:
        if os.path.exists(path):
            return path
        time.sleep(0.01)
    raise RuntimeError(f"timed out after {t} s waiting for {path} {what}")


def repeat_rid(rid, k):
    """Request id of the k-th repeated hand-off of request ``rid``."""
    return 10_000_000 + rid * 1000 + k


def ref_name(k):
    """File stem of reference process ``k`` (0: the one compared with)."""
    return "reference" if k == 0 else f"reference{k}"


def role_reference(a):
    """The monolithic reference. Process 0 runs every case twice (the
    in-process control) and keeps the first run; processes 1.. (started at
    the same time, so they share the device with process 0) run every case
    once, for the cross-process control."""
    setup_torch(a)
    k = a.ref_index
    out = {"role": ref_name(k), "weights_sha256": {}}
    model = {}
    for case in plan(a):
        attn = case["attn"]
        if attn not in model:
            model[attn], out["weights_sha256"][attn] = build_model(a, attn)
        r = reference_run(a, model[attn], case, tally=True)
        if k == 0:
            r["in_process"] = self_check(case, r, reference_run(a, model[attn], case))
        suffix = ".ref.pt" if k == 0 else f".ref{k}.pt"
        atomic_torch_save(r, os.path.join(a.workdir, case["key"] + suffix))
        print(f"[{ref_name(k)}] {case['key']} done" +
              (f" (in-process rerun identical: {r['in_process']['identical']})" if k == 0 else ""), flush=True)
    out["sdpa_gqa"] = dict(_SDPA["gqa"])
    out["env"] = device_desc(a)
    atomic_write(os.path.join(a.workdir, ref_name(k) + ".done.json"), json.dumps(out))


def attach(a, role, nb):
    import torch
    import kvfabric

    dev = -1 if a.host_pools else torch.device(a.device).index or 0
    layout = kvfabric.Layout.for_model(layers=a.layers, num_blocks=nb, total_kv_heads=a.kv_heads,
                                       head_dim=a.head_dim, block_tokens=BLOCK_TOKENS, dtype=a.dtype,
                                       device=dev)
    client = kvfabric.Client(a.sock, timeout=10.0)
    s = client.attach(a.engine_id, "uid-" + a.engine_id, role, layout)
    if a.host_pools:
        shm = kvfabric.ShmPool.for_layout(layout)
        raw = shm.torch()
        s.register_shm(shm)
        # The agent has mapped it: drop the name so a killed engine leaves
        # nothing in /dev/shm.
        shm.unlink()
        keep = shm
    else:
        raw = torch.zeros(layout.pool_bytes(), dtype=torch.uint8, device=a.device)
        torch.cuda.synchronize()
        s.register_tensor(raw)
        keep = raw
    pool = PagedPool(raw, a.layers, nb, a.kv_heads, a.head_dim, a.dtype)
    # Our offsets are the client's.
    assert pool.pool_bytes() == layout.pool_bytes() and pool.block_bytes == layout.block_bytes
    for (l, p, b) in ((0, 0, 0), (a.layers - 1, 1, nb - 1), (a.layers // 2, 0, nb // 2)):
        assert pool.block_offset(l, p, b) == layout.block_offset(l, p, b)
    return s, pool, layout, keep


def role_prefill(a):
    setup_torch(a)
    import kvfabric

    nb = pool_blocks(a)
    model = {}
    out = {"role": "prefill", "weights_sha256": {}}
    s, pool, layout, keep = attach(a, "prefill", nb)
    alloc = BlockAllocator(nb, a.seed + 1)
    atomic_write(os.path.join(a.workdir, "prefill.ready"), s.id)
    warmed = set()
    for case in plan(a):
        attn = case["attn"]
        if attn not in model:
            model[attn], out["weights_sha256"][attn] = build_model(a, attn)
        if (attn, case["backend"]) not in warmed:
            warm_up(a, model[attn], case)
            warmed.add((attn, case["backend"]))
        key = case["key"]
        ids, mask = prompts(a, case)
        lens, P = case["lens"], max(case["lens"])
        # Prefill compute time: the first run is the one served; more runs
        # (outputs dropped) give p50/p99.
        prefill_ms = []
        for k in range(1 + (a.repeats if not case["negative"] else 0)):
            sync(a)
            if k == 0:
                tally_start()
            t0 = time.perf_counter()
            with attn_ctx(a, case):
                res = prefill(model[attn], ids, mask)
            sync(a)
            prefill_ms.append((time.perf_counter() - t0) * 1e3)
            if k == 0:
                cache, pl, first = res
                sdpa_dispatch = tally_take()
                layout = cache_layout(cache)
            del res
        # The router: the decode engine's block ids.
        dst = json.load(open(wait_file(os.path.join(a.workdir, key + ".dst.json"), 120, "(decode blocks)")))
        src_blocks = [alloc.alloc(blocks_needed([n])) for n in lens]
        kv = cache_layers(cache)
        t0 = time.perf_counter()
        for i, n in enumerate(lens):
            pool.write(kv, i, P - n, n, src_blocks[i])
        sync(a)  # the agent reads the pool: every write must have landed
        write_ms = (time.perf_counter() - t0) * 1e3
        digests = [kv_digest(request_kv(kv, i, P - n, n)) for i, n in enumerate(lens)]
        pool_digests = [kv_digest(pool.read(src_blocks[i], n)) for i, n in enumerate(lens)]
        del cache, kv
        # Hand every request off separately, all at once.
        t0 = time.perf_counter()
        futs = [s.transfer_async(rid, a.peer, src_blocks[i], dst["dst_blocks"][i], path=a.path,
                                 timeout_ms=60000) for i, rid in enumerate(case["rids"])]
        results = []
        for i, f in enumerate(futs):
            try:
                try:
                    r = f.result(timeout=120)
                except kvfabric.FailedPrecondition as e:
                    if "GPU pools" in str(e):
                        # A refusal by design (STANDARD is not available
                        # for GPU pools), not a handshake still in progress.
                        raise
                    r = None
                except kvfabric.NotFound:
                    r = None
                if r is None:
                    # The decode engine not yet in this agent's discovery
                    # view, or the bounce handshake with its agent not yet
                    # done: again, until it is (at most 30 s).
                    deadline = time.time() + 30
                    while True:
                        time.sleep(0.05)
                        try:
                            r = s.transfer_blocks(case["rids"][i], a.peer, src_blocks[i], dst["dst_blocks"][i],
                                                  path=a.path, timeout_ms=60000)
                            break
                        except (kvfabric.NotFound, kvfabric.FailedPrecondition):
                            if time.time() > deadline:
                                raise
                results.append({"outcome": r.outcome, "reason": r.reason, "path": r.path, "bytes": r.bytes,
                                "descriptors": r.descriptors, "submit_us": r.submit_us,
                                "transfer_us": r.transfer_us})
            except kvfabric.KvfabricError as e:
                results.append({"outcome": "error", "reason": str(e)})
        handoff_ms = (time.perf_counter() - t0) * 1e3
        # More hand-offs of the same blocks, one at a time, for p50/p99 (the
        # decode engine awaits them all before it reads its blocks).
        repeats = [[] for _ in lens]
        if not case["negative"] and all(r["outcome"] == "success" for r in results):
            for i, rid in enumerate(case["rids"]):
                for k in range(a.repeats):
                    r = s.transfer_blocks(repeat_rid(rid, k), a.peer, src_blocks[i], dst["dst_blocks"][i],
                                          path=a.path, timeout_ms=60000)
                    repeats[i].append({"outcome": r.outcome, "transfer_us": r.transfer_us,
                                       "submit_us": r.submit_us})
        for b in src_blocks:
            alloc.release(b)
        atomic_torch_save({"prefill_logits": pl.cpu()}, os.path.join(a.workdir, key + ".prefill.pt"))
        atomic_write(os.path.join(a.workdir, key + ".prefill.json"), json.dumps({
            "first_tokens": [int(x) for x in first.cpu()], "prefill_ms": [round(x, 3) for x in prefill_ms],
            "pool_write_ms": round(write_ms, 3), "handoff_wall_ms": round(handoff_ms, 3),
            "src_blocks": src_blocks, "transfers": results, "repeats": repeats,
            "kv_sha256": digests, "pool_kv_sha256": pool_digests, "layout": layout,
            "sdpa_dispatch": sdpa_dispatch}))
        print(f"[prefill] {key}: " + ", ".join(f"{r['outcome']} {r.get('bytes')} B {r.get('transfer_us')} us"
                                               + (f" ({r['reason']})" if r.get("reason") else "")
                                               for r in results), flush=True)
    atomic_write(os.path.join(a.workdir, "prefill.done.json"), json.dumps(out))
    s.close()
    if a.host_pools:
        keep.unlink()  # the name; the agent's mapping lives on until it lets go
    del keep


def role_decode(a):
    torch = setup_torch(a)

    nb = pool_blocks(a)
    model = {}
    out = {"role": "decode", "weights_sha256": {}}
    s, pool, layout, keep = attach(a, "decode", nb)
    alloc = BlockAllocator(nb, a.seed + 2)
    atomic_write(os.path.join(a.workdir, "decode.ready"), s.id)
    for case in plan(a):
        attn = case["attn"]
        if attn not in model:
            model[attn], out["weights_sha256"][attn] = build_model(a, attn)
        key = case["key"]
        lens = case["lens"]
        # Allocate first, then tell the prefill engine (the router's job).
        dst_blocks = [alloc.alloc(blocks_needed([n])) for n in lens]
        futs = [s.await_arrival_async(rid, a.peer, timeout=90) for rid in case["rids"]]
        atomic_write(os.path.join(a.workdir, key + ".dst.json"), json.dumps({"dst_blocks": dst_blocks}))
        t0 = time.perf_counter()
        arrivals = []
        for f in futs:
            try:
                r = f.result(timeout=120)
                arrivals.append({"outcome": r.outcome, "reason": r.reason, "bytes": r.bytes,
                                 "src_engine": r.src_engine})
            except Exception as e:  # noqa: BLE001 - recorded, the case fails
                arrivals.append({"outcome": "error", "reason": str(e)})
        arrival_wait_ms = (time.perf_counter() - t0) * 1e3
        # The first tokens, from the prefill engine through the router.
        pre = json.load(open(wait_file(os.path.join(a.workdir, key + ".prefill.json"), 120, "(first tokens)")))
        res = {"arrivals": arrivals, "dst_blocks": dst_blocks, "arrival_wait_ms": round(arrival_wait_ms, 3)}
        # The repeated hand-offs (same bytes) have all resolved on the
        # sender before it wrote prefill.json; collect their arrivals.
        res["repeat_arrivals"] = []
        for i, rid in enumerate(case["rids"]):
            oks = 0
            for k in range(len(pre["repeats"][i])):
                try:
                    oks += s.await_arrival(repeat_rid(rid, k), a.peer, timeout=30).ok
                except Exception:  # noqa: BLE001 - counted as not arrived
                    pass
            res["repeat_arrivals"].append(oks)
        if all(x["outcome"] == "success" for x in arrivals):
            res["kv_sha256"] = [kv_digest(pool.read(b, n)) for b, n in zip(dst_blocks, lens)]
            if case["negative"]:
                res["corrupted_byte"] = pool.corrupt(dst_blocks[0][0])
            _, mask = prompts(a, case)  # the mask only (the decode side knows the lengths)
            t0 = time.perf_counter()
            cache = rebuild(model[attn], pool, case, dst_blocks)
            sync(a)
            res["rebuild_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
            res["layout"] = cache_layout(cache)
            first = torch.tensor(pre["first_tokens"], dtype=torch.long, device=a.device)
            tally_start()
            t0 = time.perf_counter()
            with attn_ctx(a, case):
                logits, toks = decode(model[attn], cache, mask, lens, first, a.steps)
            sync(a)
            res["decode_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
            res["sdpa_dispatch"] = tally_take()
            del cache
            atomic_torch_save({"logits": logits.cpu(), "tokens": toks.cpu()},
                              os.path.join(a.workdir, key + ".decode.pt"))
        for b in dst_blocks:
            alloc.release(b)
        atomic_write(os.path.join(a.workdir, key + ".decode.json"), json.dumps(res))
        print(f"[decode] {key}: arrivals " + ", ".join(x["outcome"] for x in arrivals), flush=True)
    atomic_write(os.path.join(a.workdir, "decode.done.json"), json.dumps(out))
    s.close()
    if a.host_pools:
        keep.unlink()  # the name; the agent's mapping lives on until it lets go
    del keep


# --------------------------------------------------------------------------
# coordinator


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


DATA_METRICS = ("kvfabric_data_uniform_total", "kvfabric_data_wire_bytes_total",
                "kvfabric_chunks_written_total")


def metric_values(base, names, timeout=5.0):
    """Each of the metrics `names` in `base`/metrics, summed over its label
    sets; None for a metric the agent does not export."""
    try:
        with urllib.request.urlopen(base + "/metrics", timeout=timeout) as r:
            text = r.read().decode()
    except Exception as e:  # noqa: BLE001 - reported
        return {"error": str(e)}
    out = {n: None for n in names}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        # name{labels} value [timestamp]: the value is the first token
        # after the labels (label values may hold spaces).
        name, _, rest = line.partition("{")
        if rest:
            rest = rest.rpartition("}")[2]
        else:
            name, _, rest = line.partition(" ")
        name = name.strip()
        if name in out:
            try:
                out[name] = (out[name] or 0.0) + float(rest.split()[0])
            except (ValueError, IndexError):
                pass
    return out


def http_json(url, timeout=5.0):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return json.loads(r.read().decode())
    except Exception as e:  # noqa: BLE001 - reported
        return {"error": str(e)}


MODEL_ARGS = ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "max_positions",
              "dtype", "seed", "steps", "cases", "attn", "sdpa_backend", "device", "num_blocks", "path", "repeats",
              "ref_procs")


def child_args(a):
    args = []
    for k in MODEL_ARGS:
        args += ["--" + k.replace("_", "-"), str(getattr(a, k))]
    if not a.negative_control:
        args.append("--no-negative-control")
    if a.host_pools:
        args.append("--host-pools")
    return args


def run_agents(a):
    import torch

    tmp = tempfile.mkdtemp(prefix="kvf-model-")
    report = {"mode": "host-pools" if a.host_pools else "gpu", "device": a.device, "dtype": a.dtype,
              "torch": torch.__version__, "model": model_desc(a), "num_blocks": pool_blocks(a),
              "sdpa_backend": a.sdpa_backend,
              "reference_runs": {"in_process": 2, "processes": a.ref_procs, "concurrent": True},
              "workdir": tmp, "cases": [], "ok": False}
    try:
        import transformers

        report["transformers"] = transformers.__version__
    except Exception:  # noqa: BLE001
        pass
    procs, logs = [], {}

    def child(role, extra, log_name):
        log = open(os.path.join(tmp, log_name + ".log"), "w")
        logs[log_name] = log.name
        p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--out", a.out, *child_args(a),
                              "--role", role, "--workdir", tmp, *extra], stdout=log, stderr=subprocess.STDOUT)
        procs.append(p)
        return p

    def wait_done(path, p, t, name):
        end = time.time() + t
        while time.time() < end:
            if os.path.exists(path):
                return json.load(open(path))
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with {p.returncode}: {open(logs[name]).read()[-4000:]}")
            time.sleep(0.05)
        raise RuntimeError(f"{name} did not finish in {t} s: {open(logs[name]).read()[-4000:]}")

    agents = {}
    try:
        # 1. The monolithic reference: process 0 (every case twice) and
        # processes 1.. (every case once) at the same time, alone on the
        # device otherwise.
        t0 = time.time()
        rps = [child("reference", ["--ref-index", str(k)], ref_name(k)) for k in range(a.ref_procs)]
        refs = [wait_done(os.path.join(tmp, ref_name(k) + ".done.json"), p, 600, ref_name(k))
                for k, p in enumerate(rps)]
        report["reference"] = refs[0]
        report["reference"]["wall_s"] = round(time.time() - t0, 1)
        report["reference_others"] = refs[1:]
        report["env"] = refs[0].get("env")
        report["sdpa_gqa"] = refs[0].get("sdpa_gqa")
        for p in rps:
            p.wait(timeout=30)
        # 2. etcd and two agents.
        cport, pport = free_port(), free_port()
        etcd = subprocess.Popen([a.etcd, "--name", "m", "--data-dir", os.path.join(tmp, "etcd"),
                                 "--listen-client-urls", f"http://127.0.0.1:{cport}",
                                 "--advertise-client-urls", f"http://127.0.0.1:{cport}",
                                 "--listen-peer-urls", f"http://127.0.0.1:{pport}",
                                 "--initial-advertise-peer-urls", f"http://127.0.0.1:{pport}",
                                 "--initial-cluster", f"m=http://127.0.0.1:{pport}", "--log-level", "error"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(etcd)
        env = dict(os.environ, KVFABRIC_BOUNCE_ENABLE="1", KVFABRIC_BOUNCE_ARENA_SIZE_BYTES=a.arena,
                   KVFABRIC_BOUNCE_MIN_DESCRIPTOR_COUNT="1", KVFABRIC_LOG="info",
                   UCX_CUDA_IPC_ENABLE_SAME_PROCESS="y", NO_COLOR="1")
        time.sleep(1.5)
        for name, role in (("node-a", "prefill"), ("node-b", "decode")):
            sock = os.path.join(tmp, name + ".sock")
            log = open(os.path.join(tmp, name + ".log"), "w")
            logs[name] = log.name
            gpu = [] if a.host_pools else ["--gpu", str(torch.device(a.device).index or 0)]
            p = subprocess.Popen([a.bin, "agent", *gpu, "--engine-socket", sock,
                                  "--listen", "127.0.0.1:0", "--control-bind", "loopback",
                                  "--pool-size", "16MiB", "--etcd", f"http://127.0.0.1:{cport}",
                                  "--fabric", "model", "--logical-id", name, "--role", role],
                                 env=env, stdout=subprocess.PIPE, stderr=log, text=True)
            procs.append(p)
            line = p.stdout.readline()
            if "listening on" not in line:
                raise RuntimeError(f"{name} did not start: {line!r}; log {open(log.name).read()[-3000:]}")
            agents[name] = {"sock": sock, "http": line.strip().split("listening on ", 1)[1]}
        report["agents"] = {k: v["http"] for k, v in agents.items()}
        # 3. The engines: decode first (it allocates and publishes), then prefill.
        dp = child("decode", ["--sock", agents["node-b"]["sock"], "--engine-id", "decode-0",
                              "--peer", "prefill-0"], "decode")
        wait_file(os.path.join(tmp, "decode.ready"), 120, "(decode engine attached)")
        pp = child("prefill", ["--sock", agents["node-a"]["sock"], "--engine-id", "prefill-0",
                               "--peer", "decode-0"], "prefill")
        report["prefill"] = wait_done(os.path.join(tmp, "prefill.done.json"), pp, 600, "prefill")
        report["decode"] = wait_done(os.path.join(tmp, "decode.done.json"), dp, 600, "decode")
        report["peers"] = {k: http_json(v["http"] + "/v1/peers") for k, v in agents.items()}
        report["bounce_effective"] = {k: http_json(v["http"] + "/v1/config").get("bounce_effective")
                                      for k, v in agents.items()}
        # Which DATA form carried the hand-offs (issue 18 step 3).
        report["data_messages"] = {k: metric_values(v["http"], DATA_METRICS) for k, v in agents.items()}
        print(f"data messages sent per agent: {report['data_messages']}", flush=True)
        # 4. Compare.
        ok = True
        fps = {k: report[k]["weights_sha256"] for k in ("reference", "prefill", "decode")}
        fps.update({r["role"]: r["weights_sha256"] for r in report["reference_others"]})
        report["weights_identical"] = len({json.dumps(v, sort_keys=True) for v in fps.values()}) == 1
        ok &= report["weights_identical"]
        lat = {}  # (attn, kind, tokens) -> transfer_us / prefill_ms samples
        for case in plan(a):
            key = case["key"]
            ref = torch.load(os.path.join(tmp, key + ".ref.pt"))
            pre = json.load(open(os.path.join(tmp, key + ".prefill.json")))
            dec = json.load(open(os.path.join(tmp, key + ".decode.json")))
            pms = pre["prefill_ms"]
            others = [torch.load(os.path.join(tmp, key + f".ref{k}.pt")) for k in range(1, a.ref_procs)]
            ctl = {"in_process": ref["in_process"], "cross_process": [self_check(case, ref, o) for o in others]}
            ref_self = ctl["in_process"]["identical"] and all(x["identical"] for x in ctl["cross_process"])
            lay = {"reference_native": ref["layout"], "prefill_native": pre["layout"],
                   "decode_rebuilt": dec.get("layout")}
            lay_ok = None if lay["decode_rebuilt"] is None else \
                layout_key(lay["decode_rebuilt"]) == layout_key(lay["reference_native"]) == \
                layout_key(lay["prefill_native"])
            c = {"case": key, "attn": case["attn"], "sdpa_backend": case["backend"],
                 "negative_control": case["negative"], "batch": len(case["lens"]),
                 "reference_self_identical": ref_self, "reference_control": ctl,
                 "cache_layout_identical": lay_ok,
                 "cache_layout": {k: (layout_summary(v) if v else None) for k, v in lay.items()},
                 "sdpa_dispatch": {"reference": ref.get("sdpa_dispatch"), "prefill": pre.get("sdpa_dispatch"),
                                   "decode": dec.get("sdpa_dispatch")},
                 "prefill_ms": pms[0],
                 "prefill_ms_runs": {"n": len(pms), "p50": pct(pms, 0.5), "p99": pct(pms, 0.99)},
                 "pool_write_ms": pre["pool_write_ms"], "handoff_wall_ms": pre["handoff_wall_ms"],
                 "arrival_wait_ms": dec["arrival_wait_ms"], "rebuild_ms": dec.get("rebuild_ms"),
                 "decode_ms": dec.get("decode_ms"), "reference_nonfinite_kv": ref["nonfinite_kv"]}
            extra = []
            for i, n in enumerate(case["lens"]):
                t = pre["transfers"][i]
                reps = pre["repeats"][i]
                us = [t["transfer_us"]] * (t.get("outcome") == "success") + \
                    [r["transfer_us"] for r in reps if r["outcome"] == "success"]
                kv = {"reference": ref["kv_sha256"][i], "prefill_cache": pre["kv_sha256"][i],
                      "prefill_pool": pre["pool_kv_sha256"][i],
                      "decode_pool": (dec.get("kv_sha256") or [None] * len(case["lens"]))[i]}
                extra.append({"transfer": t, "bytes": t.get("bytes"), "path": t.get("path"),
                              "transfer_us": t.get("transfer_us"), "submit_us": t.get("submit_us"),
                              "handoffs": {"n": len(us), "transfer_us_p50": pct(us, 0.5),
                                           "transfer_us_p99": pct(us, 0.99),
                                           "repeats_ok": sum(r["outcome"] == "success" for r in reps),
                                           "repeats_arrived": dec["repeat_arrivals"][i], "repeats": len(reps)},
                              "arrival": dec["arrivals"][i], "blocks": len(pre["src_blocks"][i]),
                              "src_blocks_head": pre["src_blocks"][i][:6],
                              "dst_blocks_head": dec["dst_blocks"][i][:6],
                              "kv_sha256": kv, "kv_identical": len(set(kv.values())) == 1})
                if not case["negative"]:
                    k3 = (case["variant"], "single" if len(case["lens"]) == 1 else "batch", n)
                    d = lat.setdefault(k3, {"transfer_us": [], "prefill_ms": pms})
                    d["transfer_us"] += us
            handed = all(t.get("outcome") == "success" for t in pre["transfers"]) and \
                all(x["outcome"] == "success" for x in dec["arrivals"])
            dpath = os.path.join(tmp, key + ".decode.pt")
            if handed and os.path.exists(dpath):
                got = torch.load(dpath)
                got["prefill_logits"] = torch.load(os.path.join(tmp, key + ".prefill.pt"))["prefill_logits"]
                c["requests"] = compare(case, ref, got, extra)
            else:
                c["requests"] = [dict(e, bit_identical=False, tokens=n, steps=0, error="hand-off failed")
                                 for e, n in zip(extra, case["lens"])]
            kv_ok = all(r["kv_identical"] for r in c["requests"])
            c["diagnosis"] = diagnose(case, c["requests"], ref_self, lay_ok)
            if case["negative"]:
                c["corrupted_byte"] = dec.get("corrupted_byte")
                c["differs_as_expected"] = handed and kv_ok and not any(r["bit_identical"] for r in c["requests"])
                c["passed"] = c["differs_as_expected"]
            else:
                reps_ok = all(r["handoffs"]["repeats_ok"] == r["handoffs"]["repeats"] == r["handoffs"]["repeats_arrived"]
                              for r in c["requests"])
                c["passed"] = handed and kv_ok and reps_ok and all(
                    r["bit_identical"] and r.get("prefill_logits_identical", False) for r in c["requests"])
            c["counts_for_ok"] = counts_for_ok(a, case)
            ok &= c["passed"] or not c["counts_for_ok"]
            report["cases"].append(c)
        report["latency"] = [
            {"attn": k[0], "kind": k[1], "tokens": k[2], "handoffs": len(v["transfer_us"]),
             "transfer_us_p50": pct(v["transfer_us"], 0.5), "transfer_us_p99": pct(v["transfer_us"], 0.99),
             "prefill_runs": len(v["prefill_ms"]), "prefill_ms_p50": pct(v["prefill_ms"], 0.5),
             "prefill_ms_p99": pct(v["prefill_ms"], 0.99)}
            for k, v in lat.items()]
        report["reference_self_identical"] = all(c["reference_self_identical"] for c in report["cases"])
        report["ok"] = bool(ok)
        report["ok_all"] = bool(ok and all(c["passed"] for c in report["cases"]))
    except Exception as e:  # noqa: BLE001 - the report says what failed
        report["error"] = f"{type(e).__name__}: {e}"
    finally:
        for p in reversed(procs):
            try:
                p.send_signal(signal.SIGTERM)
            except Exception:  # noqa: BLE001
                pass
        for p in procs:
            try:
                p.wait(timeout=15)
            except Exception:  # noqa: BLE001
                p.kill()
        report["log_tail"] = {k: open(v).read()[-3000:] for k, v in logs.items()}
        # The work dir (logs, logits, pools: ~60 MB) is kept only when a
        # case failed, or with KVF_KEEP_WORKDIR=1; a passing run leaves
        # nothing behind in the temp dir.
        if report.get("ok_all") and os.environ.get("KVF_KEEP_WORKDIR", "0") != "1":
            shutil.rmtree(tmp, ignore_errors=True)
            report["workdir_removed"] = True
    return report


def summary(report):
    lines = []
    for c in report.get("cases", []):
        for r in c["requests"]:
            lines.append(f"{c['case']:<44} {r['tokens']:>5} tok  steps {r.get('steps')}  bit_identical "
                         f"{r['bit_identical']}  first_mismatch {r.get('first_mismatch_step')}  "
                         f"ref_self_identical {c.get('reference_self_identical')}  "
                         f"bytes {r.get('bytes')}  transfer_us {r.get('transfer_us')}  path {r.get('path')}")
        lines.append(f"{'':<44} layout_identical {c.get('cache_layout_identical')}  diagnosis: {c.get('diagnosis')}"
                     f"  sdpa {json.dumps(c.get('sdpa_dispatch'), separators=(',', ':'))}")
    lines.append(f"sdpa_backend: {report.get('sdpa_backend')}  gqa: {report.get('sdpa_gqa')}  "
                 f"reference_self_identical: {report.get('reference_self_identical')}")
    lines.append(f"ok: {report['ok']}  ok_all: {report.get('ok_all')}" +
                 (f"  error: {report['error']}" if report.get("error") else ""))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", help="the kvfabric binary (agent runs)")
    ap.add_argument("--etcd", help="the etcd binary (agent runs)")
    ap.add_argument("--out", required=True, help="the JSON report")
    ap.add_argument("--local", action="store_true", help="no agents: a pure-torch block copy stands in for the fabric")
    ap.add_argument("--host-pools", action="store_true", help="agent run with POSIX shm pools (no --gpu), e.g. on CPU")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--attn", default="eager,sdpa", help="attention implementations, comma separated")
    ap.add_argument("--sdpa-backend", default="auto",
                    help="the SDPA backend the sdpa cases are pinned to (torch.nn.attention.sdpa_kernel, the same "
                         "in every process): efficient, math, flash, cudnn, or default (not pinned: PyTorch "
                         "picks); auto = efficient on CUDA, math on the CPU; comma separated runs the sdpa cases "
                         "once per backend (cases sdpa-<backend>-...)")
    ap.add_argument("--ref-procs", type=int, default=2,
                    help="reference processes run at the same time (the first runs every case twice): the "
                         "control for the compute's own run-to-run determinism")
    ap.add_argument("--cases", default="517;2048;8000;517,1000,2048,3000;1024x4",
                    help="';' between cases, ',' between the prompt lengths of a batch, NxK = K prompts of N")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--max-positions", type=int, default=16384)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--num-blocks", type=int, default=0, help="pool blocks (0: twice the largest case)")
    ap.add_argument("--path", default="bounce", help="transfer path: bounce, auto or standard")
    ap.add_argument("--arena", default="512MiB", help="KVFABRIC_BOUNCE_ARENA_SIZE_BYTES")
    ap.add_argument("--repeats", type=int, default=5,
                    help="more hand-offs of each request and more prefill runs, for p50/p99")
    ap.add_argument("--no-negative-control", dest="negative_control", action="store_false")
    # internal: the engine and reference processes
    ap.add_argument("--role", choices=("reference", "prefill", "decode"), help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    ap.add_argument("--sock", help=argparse.SUPPRESS)
    ap.add_argument("--engine-id", help=argparse.SUPPRESS)
    ap.add_argument("--peer", help=argparse.SUPPRESS)
    ap.add_argument("--ref-index", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    try:
        a.sdpa_backend = ",".join(resolve_sdpa_backends(a.sdpa_backend, a.device))
    except ValueError as e:
        ap.error(str(e))
    if not 1 <= a.ref_procs <= 4:
        ap.error("--ref-procs: 1..4")
    if max(max(c) for c in parse_cases(a.cases)) + a.steps + 1 > a.max_positions:
        ap.error("a prompt plus the decode steps exceeds --max-positions")
    if not 0 <= a.repeats < 1000:
        ap.error("--repeats: 0..999")
    if a.role:
        {"reference": role_reference, "prefill": role_prefill, "decode": role_decode}[a.role](a)
        return
    if a.local:
        report = run_local(a)
    else:
        if not a.bin or not a.etcd:
            ap.error("--bin and --etcd are needed (or --local)")
        report = run_agents(a)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=2)
    print(summary(report))
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
