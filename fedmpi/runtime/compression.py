"""Compressed messages, counted at their exact encoded size (``[compression]``).

A codec turns a float32 vector into what the receiver decodes, and says how many bytes
the encoding takes. Encoding happens where the client trains; what the server aggregates
is exactly the decoded vector, so the simulation needs no bit packing, only the exact
count. Nothing travels as a header: the codec, d, k, the bit width and the bucket size
are fixed by the config and known to both sides.

Upload codecs (``compression.up``), on an n-value message:

- ``fp16``, ``bf16``: the values cast; 2n bytes.
- ``qsgd``: stochastic quantization with a norm scale per bucket (Alistarh et al.,
  "QSGD", 2017; the quantizer of FedPAQ, Reisizadeh et al. 2020). Each value is sent as
  a sign bit and a level l in 0..s, s = 2^b - 1 (``bits`` b), of the bucket's L2 norm:
  v_i -> ||v|| sign(v_i) l / s, l rounded up with probability (the remainder), so the
  decoded vector is unbiased. Bytes: 4 per bucket (the norm, float32) + ceil(n (b + 1) / 8).
  ``bucket`` = 0: one bucket, the whole vector.
- ``topk``: the k largest magnitudes, k = ``count`` or ceil(``fraction`` n). Bytes: 4k for
  the values + the indices, at ceil(log2 n) bits each or a bitmap of n bits, whichever
  is smaller, rounded up to whole bytes (none when k = n: every value, in order).
- ``randk``: k coordinates drawn uniformly from the client's stream keyed by (seed,
  round, client), which the server can draw too: 4k bytes, no indices. Not rescaled
  (a contraction, for error feedback; rescale by n/k yourself for an unbiased one).
- ``sign``: scaled sign (Karimireddy et al., "Error Feedback Fixes SignSGD", 2019):
  ||v||_1 / n * sign(v), a zero sent as +. Bytes: ceil(n / 8) + 4.

Error feedback (``error_feedback = true``) keeps a per-client vector in the client state
store (it spills and checkpoints like SCAFFOLD's c_i): classic (``feedback = "ef"``, Stich
et al. 2018; Karimireddy et al. 2019) sends C(v + e) and keeps e <- v + e - C(v + e);
EF21 (``"ef21"``, Richtarik et al. 2021) sends C(v - g) and both sides move g <- g +
C(v - g), which is the decoded message. Download codecs (``compression.down``): ``fp16``
or ``bf16`` casts of the payload, the same for every client.

Which messages may be compressed is the algorithm's declaration
(``Algorithm.compressible``): the model delta, and vectors such as SCAFFOLD's control
variates; a scalar such as FedNova's a_i is not. Everything else in ``traffic`` is
counted at 4 bytes a value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config.schema import CompressionConfig
from ..flat import WIRE_BYTES
from .rng import torch_generator

CASTS = {"fp16": torch.float16, "bf16": torch.bfloat16}
RANDOM = ("qsgd", "randk")   # codecs that draw from the client's keyed stream


def index_bits(n: int) -> int:
    """Bits of one index into n values."""
    return max(1, math.ceil(math.log2(n))) if n > 1 else 1


def kept(n: int, fraction: float, count: int) -> int:
    """k of top-k / rand-k on n values: ``count`` where given, else ceil(fraction n)."""
    if count:
        return min(count, n)
    return max(1, min(n, math.ceil(fraction * n - 1e-9)))


@dataclass(frozen=True)
class Codec:
    """One codec with its settings (``CompressionConfig``'s fields)."""
    name: str = "none"
    bits: int = 8
    bucket: int = 0
    fraction: float = 0.01
    count: int = 0

    def encoded_bytes(self, n: int) -> int:
        """Exact bytes of an n-value message."""
        if n == 0:
            return 0
        if self.name == "none":
            return 4 * n
        if self.name in CASTS:
            return 2 * n
        if self.name == "qsgd":
            buckets = 1 if not self.bucket else -(-n // self.bucket)
            return 4 * buckets + -(-n * (self.bits + 1) // 8)
        if self.name == "topk":
            k = kept(n, self.fraction, self.count)
            return 4 * k + (0 if k == n else -(-min(k * index_bits(n), n) // 8))
        if self.name == "randk":
            return 4 * kept(n, self.fraction, self.count)
        if self.name == "sign":
            return -(-n // 8) + 4
        raise ValueError(f"unknown codec {self.name!r}")

    def decode(self, v: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """What the receiver decodes from the encoding of v (float32, 1-D)."""
        n = v.numel()
        if self.name == "none" or n == 0:
            return v
        if self.name in CASTS:
            return v.to(CASTS[self.name]).to(v.dtype)
        if self.name == "qsgd":
            return self._qsgd(v, generator)
        if self.name == "topk":
            k = kept(n, self.fraction, self.count)
            if k == n:
                return v.clone()
            out = torch.zeros_like(v)
            idx = torch.topk(v.abs(), k, sorted=False).indices
            out[idx] = v[idx]
            return out
        if self.name == "randk":
            k = kept(n, self.fraction, self.count)
            if k == n:
                return v.clone()
            out = torch.zeros_like(v)
            idx = torch.randperm(n, generator=generator, device="cpu")[:k].to(v.device)
            out[idx] = v[idx]
            return out
        if self.name == "sign":
            scale = v.abs().sum() / n
            return torch.where(v >= 0, scale, -scale)
        raise ValueError(f"unknown codec {self.name!r}")

    def _qsgd(self, v: torch.Tensor, generator) -> torch.Tensor:
        n, s = v.numel(), 2 ** self.bits - 1
        size = min(self.bucket, n) if self.bucket else n   # a bucket past the end is the vector
        rows = -(-n // size)
        padded = torch.zeros(rows * size, dtype=v.dtype, device=v.device)
        padded[:n] = v
        b = padded.view(rows, size)
        norm = torch.linalg.vector_norm(b, dim=1, keepdim=True)
        r = b.abs() / torch.where(norm > 0, norm, torch.ones_like(norm)) * s
        low = torch.floor(r)
        u = torch.rand(b.shape, generator=generator, device="cpu").to(v.device)
        level = low + (u < r - low).to(v.dtype)
        return (torch.sign(b) * level * norm / s).reshape(-1)[:n]


class Compression:
    """The run's codecs and error feedback (``config.compression``): the bytes of each
    message and, on the worker, what the server decodes from a client's upload."""

    def __init__(self, config, alg, d: int):
        c = config.compression if config is not None else CompressionConfig()   # None: off
        self.up = Codec(c.up, c.bits, c.bucket, c.fraction, c.count)
        self.down = Codec(c.down)
        self.seed, self.alg = (config.seed if config is not None else 0), alg
        declared = alg.compressible(d)
        self.uploads = {} if c.up == "none" else {m: declared["up"][m] for m in c.messages}
        self.downloads = {} if c.down == "none" else declared["down"]
        self.feedback = c.feedback if c.error_feedback and self.uploads else None

    def state_sizes(self) -> dict[str, int]:
        """The error-feedback vectors each client keeps, one per compressed upload."""
        if self.feedback is None:
            return {}
        return {f"{self.feedback}_{name}": n for name, n in self.uploads.items()}

    def message_bytes(self, d: int, phase: str) -> tuple[int, int]:
        """(bytes down, bytes up) of one participation in ``phase``: the compressible
        vectors at their encoded size, every other value of ``traffic`` at 4 bytes."""
        down, up = self.alg.traffic(d, phase)
        return (WIRE_BYTES * (down - sum(self.downloads.values()))
                + sum(self.down.encoded_bytes(n) for n in self.downloads.values()),
                WIRE_BYTES * (up - sum(self.uploads.values()))
                + sum(self.up.encoded_bytes(n) for n in self.uploads.values()))

    def download(self, payload: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The payload as every client decodes it."""
        if not self.downloads:
            return payload
        missing = sorted(set(self.downloads) - set(payload))
        if missing:
            raise ValueError(f"{self.alg.name}: compressible downloads {missing} are not in "
                             f"its payload {sorted(payload)}")
        return {k: self.down.decode(v) if k in self.downloads else v for k, v in payload.items()}

    def upload(self, upload, state: dict | None, key: tuple[int, int, int]):
        """The upload as the server decodes it, and the client's new error-feedback
        vectors ({} without feedback). ``state``: the client's stored ones (None the
        first time: zeros); ``key``: (round, client, phase) of the codec's stream."""
        new = {}
        if not self.uploads:
            return upload, new
        for i, name in enumerate(self.uploads):
            v = upload.delta if name == "delta" else upload.extras[name]
            flat = v.reshape(-1).float()
            generator = torch_generator(self.seed, "compress", *key, i) \
                if self.up.name in RANDOM else None
            if self.feedback is None:
                sent = self.up.decode(flat, generator)
            else:
                key_name = f"{self.feedback}_{name}"
                memory = None if state is None else state.get(key_name)
                memory = torch.zeros_like(flat) if memory is None else \
                    torch.as_tensor(memory).to(flat.device)
                if self.feedback == "ef":   # send C(v + e), keep what it dropped
                    sent = self.up.decode(flat + memory, generator)
                    new[key_name] = flat + memory - sent
                else:                       # ef21: send C(v - g), g moves to the decoded
                    sent = memory + self.up.decode(flat - memory, generator)
                    new[key_name] = sent
            decoded = sent.reshape(v.shape).to(v.dtype)
            if name == "delta":
                upload.delta = decoded
            else:
                upload.extras[name] = decoded
        return upload, new
