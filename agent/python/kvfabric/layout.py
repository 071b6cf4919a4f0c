"""An engine's KV geometry (the engine API's ``KvLayout``).

A pool is layer-major::

    offset(layer, plane, block) =
        ((layer * planes + plane) * num_blocks + block) * block_bytes

with ``planes = 2`` when K and V are split (K then V), else 1. Inside a block
the bytes are ``[block_tokens][kv_heads][head_dim]`` of ``dtype``, so
``block_bytes = block_tokens * kv_heads * head_dim * dtype_bytes`` and the
pool is ``layers * planes * num_blocks * block_bytes`` bytes. ``kv_heads`` is
the number of heads *this TP rank* holds.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

from ._proto import engine_pb2 as pb
from .errors import InvalidArgument

#: Bytes per element of each dtype the agent accepts.
DTYPE_BYTES = {
    "bf16": 2,
    "fp16": 2,
    "f16": 2,
    "fp8": 1,
    "u8": 1,
    "int8": 1,
    "fp32": 4,
    "f32": 4,
}


def dtype_bytes(dtype: str) -> int:
    """Bytes of one element of ``dtype`` (InvalidArgument if unknown)."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise InvalidArgument(
            f"dtype {dtype!r}: expected bf16, fp16, fp8, fp32 or u8", call="layout"
        ) from None


_HEX = set("0123456789abcdef")


def canonical_gpu_uuid(text: str) -> str:
    """A GPU UUID in the agent's canonical text (lowercase 8-4-4-4-12, no
    prefix) from the forms CUDA tools print: ``GPU-``/``MIG-`` prefixed
    (``nvidia-smi -L``), bare hyphenated (torch), or 32 plain hex digits.
    Raises InvalidArgument naming the text otherwise."""
    bare = text
    for p in ("GPU-", "MIG-"):
        if bare.startswith(p):
            bare = bare[len(p) :]
            break
    low = bare.lower()
    parts = low.split("-")
    digits = low.replace("-", "")
    shape_ok = [len(p) for p in parts] in ([8, 4, 4, 4, 12], [32])
    if not shape_ok or len(digits) != 32 or not set(digits) <= _HEX:
        raise InvalidArgument(
            f"GPU UUID {text!r}: expected 32 hex digits as 8-4-4-4-12 (optionally prefixed "
            "GPU- or MIG-, as `nvidia-smi -L` prints it)",
            call="layout",
        )
    return f"{digits[:8]}-{digits[8:12]}-{digits[12:16]}-{digits[16:20]}-{digits[20:]}"


@dataclass(frozen=True)
class Layout:
    """Mirror of ``kvfabric.v1.KvLayout``. Build one directly (every field
    as the engine has it) or with :meth:`for_model`."""

    layers: int
    num_blocks: int
    block_bytes: int
    kv_split: bool = True
    dtype: str = "bf16"
    tp_rank: int = 0
    tp_size: int = 1
    block_tokens: int = 16
    kv_heads: int = 1
    head_dim: int = 128
    device: int = -1
    #: UUID of the engine's GPU (``str(torch.cuda.get_device_properties(d).uuid)``,
    #: or ``GPU-...`` as ``nvidia-smi -L`` prints it); "" = not given. Ordinals
    #: are per process (a pod with one GPU sees it as device 0), so the agent
    #: matches a GPU engine by this UUID where given. :meth:`Client.attach`
    #: fills it from torch for GPU layouts when torch is importable.
    device_uuid: str = ""

    @classmethod
    def for_model(
        cls,
        *,
        layers: int,
        num_blocks: int,
        total_kv_heads: int,
        head_dim: int,
        block_tokens: int = 16,
        dtype: str = "bf16",
        kv_split: bool = True,
        tp_rank: int = 0,
        tp_size: int = 1,
        device: int = -1,
        device_uuid: str = "",
    ) -> "Layout":
        """The layout of TP rank ``tp_rank`` of ``tp_size`` for a model with
        ``total_kv_heads`` KV heads (split evenly across ranks), deriving
        ``kv_heads`` and ``block_bytes``. Example: Llama-3.1-8B at TP 4 is
        ``Layout.for_model(layers=32, num_blocks=N, total_kv_heads=8,
        head_dim=128, tp_size=4, tp_rank=r)``."""
        if tp_size < 1 or total_kv_heads % tp_size != 0:
            raise InvalidArgument(
                f"total_kv_heads {total_kv_heads} is not divisible by tp_size {tp_size}",
                call="layout",
            )
        kv_heads = total_kv_heads // tp_size
        layout = cls(
            layers=layers,
            num_blocks=num_blocks,
            block_bytes=block_tokens * kv_heads * head_dim * dtype_bytes(dtype),
            kv_split=kv_split,
            dtype=dtype,
            tp_rank=tp_rank,
            tp_size=tp_size,
            block_tokens=block_tokens,
            kv_heads=kv_heads,
            head_dim=head_dim,
            device=device,
            device_uuid=device_uuid,
        )
        layout.validate()
        return layout

    def with_(self, **changes: Any) -> "Layout":
        """A copy with some fields changed (``dataclasses.replace``)."""
        return replace(self, **changes)

    # -- geometry ---------------------------------------------------------

    @property
    def planes(self) -> int:
        """K/V planes: 2 with ``kv_split``, else 1."""
        return 2 if self.kv_split else 1

    @property
    def dtype_bytes(self) -> int:
        """Bytes of one element."""
        return dtype_bytes(self.dtype)

    @property
    def token_bytes(self) -> int:
        """Bytes of one token of a block: ``kv_heads * head_dim * dtype``."""
        return self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def head_bytes(self) -> int:
        """Bytes of one head of one token: ``head_dim * dtype``."""
        return self.head_dim * self.dtype_bytes

    def pool_bytes(self) -> int:
        """Pool size: ``layers * planes * num_blocks * block_bytes``."""
        return self.layers * self.planes * self.num_blocks * self.block_bytes

    def block_offset(self, layer: int, plane: int, block: int) -> int:
        """Byte offset of ``(layer, plane, block)`` in the pool (range
        checked: IndexError outside the layout)."""
        if not 0 <= layer < self.layers:
            raise IndexError(f"layer {layer} outside 0..{self.layers}")
        if not 0 <= plane < self.planes:
            raise IndexError(f"plane {plane} outside 0..{self.planes}")
        if not 0 <= block < self.num_blocks:
            raise IndexError(f"block {block} outside 0..{self.num_blocks}")
        return (
            (layer * self.planes + plane) * self.num_blocks + block
        ) * self.block_bytes

    def validate(self) -> None:
        """The agent's own checks (raises InvalidArgument naming the first
        bad field): counts >= 1, a known dtype, tp_rank < tp_size, device >=
        -1, and block_bytes == block_tokens * kv_heads * head_dim * dtype."""

        def bad(msg: str) -> None:
            raise InvalidArgument(msg, call="layout")

        for name in ("layers", "num_blocks", "tp_size", "block_tokens", "kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                bad(f"{name} must be at least 1")
        dt = dtype_bytes(self.dtype)
        if not 0 <= self.tp_rank < self.tp_size:
            bad(f"tp_rank {self.tp_rank} must be below tp_size {self.tp_size}")
        if self.device < -1:
            bad(f"device {self.device}: expected -1 (host) or a CUDA ordinal")
        if self.device_uuid:
            if self.device < 0:
                bad(
                    f"device_uuid {self.device_uuid!r} given for a host pool (device -1): "
                    "a GPU UUID names the engine's CUDA device"
                )
            canonical_gpu_uuid(self.device_uuid)
        want = self.block_tokens * self.kv_heads * self.head_dim * dt
        if want != self.block_bytes:
            bad(
                f"block_bytes {self.block_bytes} != block_tokens {self.block_tokens} x "
                f"kv_heads {self.kv_heads} x head_dim {self.head_dim} x {dt} bytes ({self.dtype})"
            )
        if self.pool_bytes() >= 1 << 64:
            bad("pool size overflows 64 bits")

    def fingerprint(self) -> str:
        """The layout fingerprint the agent publishes (16 hex digits): FNV-1a
        over the fields two engines must agree on (layers, K/V split, dtype,
        block tokens, head dim, total KV heads)."""
        canon = (
            f"v1 layers={self.layers} kv_split={'true' if self.kv_split else 'false'} "
            f"dtype={self.dtype} block_tokens={self.block_tokens} head_dim={self.head_dim} "
            f"heads_total={self.kv_heads * self.tp_size}"
        )
        h = 0xCBF29CE484222325
        for b in canon.encode():
            h ^= b
            h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
        return f"{h:016x}"

    # -- conversions ------------------------------------------------------

    def to_proto(self) -> pb.KvLayout:
        return pb.KvLayout(
            layers=self.layers,
            num_blocks=self.num_blocks,
            block_bytes=self.block_bytes,
            kv_split=self.kv_split,
            dtype=self.dtype,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            block_tokens=self.block_tokens,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            device=self.device,
            device_uuid=self.device_uuid,
        )

    @classmethod
    def from_proto(cls, m: pb.KvLayout) -> "Layout":
        return cls(
            layers=m.layers,
            num_blocks=m.num_blocks,
            block_bytes=m.block_bytes,
            kv_split=m.kv_split,
            dtype=m.dtype,
            tp_rank=m.tp_rank,
            tp_size=m.tp_size,
            block_tokens=m.block_tokens,
            kv_heads=m.kv_heads,
            head_dim=m.head_dim,
            device=m.device,
            device_uuid=m.device_uuid,
        )

    def numpy_view(self, buf: Any, *, raw: bool = True) -> Any:
        """A numpy view of a pool buffer (memoryview, mmap, numpy array) in
        this layout: shape ``(layers, planes, num_blocks, block_tokens,
        kv_heads, head_dim * dtype_bytes)`` of uint8 with ``raw`` (the
        default; numpy has no bf16), else ``(..., head_dim)`` of the dtype
        (fp16, fp32, u8/fp8 as uint8). No copy: writes go to the pool."""
        import numpy as np

        flat = np.frombuffer(buf, dtype=np.uint8, count=self.pool_bytes())
        shape = (self.layers, self.planes, self.num_blocks, self.block_tokens, self.kv_heads)
        if raw:
            return flat.reshape(shape + (self.head_bytes,))
        np_dtype: Optional[Any] = {
            "fp16": np.float16,
            "f16": np.float16,
            "fp32": np.float32,
            "f32": np.float32,
            "fp8": np.uint8,
            "u8": np.uint8,
            "int8": np.int8,
        }.get(self.dtype)
        if np_dtype is None:
            raise InvalidArgument(f"numpy has no dtype for {self.dtype!r}: use raw=True", call="layout")
        return flat.view(np_dtype).reshape(shape + (self.head_dim,))

    def __str__(self) -> str:
        return (
            f"layers={self.layers} blocks={self.num_blocks} block_bytes={self.block_bytes} "
            f"kv_split={'true' if self.kv_split else 'false'} dtype={self.dtype} "
            f"tp={self.tp_rank}/{self.tp_size} block_tokens={self.block_tokens} "
            f"kv_heads={self.kv_heads} head_dim={self.head_dim} device={self.device}"
            + (f" device_uuid={self.device_uuid}" if self.device_uuid else "")
        )
