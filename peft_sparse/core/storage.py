"""What a saved sparse adapter holds per tensor, and how: positions, values, and (when asked) SpIEL's ages.

**Positions.** Each adapted tensor of N weights has n active positions η (sorted flat indices into its
logical (out, in) matrix). The file stores them in one of three forms, chosen per tensor
(``index_storage``; ``"auto"``, the default, takes the smallest):

* ``"list"`` — ``<module>.sparse_indices``: the sorted indices, int32 (int64 when N ≥ 2³¹): 32 bits per index.
* ``"bitmap"`` — ``<module>.sparse_index_bits``: uint8, ⌈N/8⌉ bytes; bit i of byte j says whether position
  8j + i is active (least significant bit first). N bits, whatever n.
* ``"elias-fano"`` — the Elias–Fano code of the sorted indices (P. Elias 1974, R. Fano 1971; the
  "quasi-succinct" layout of S. Vigna, WSDM 2013). With ℓ lower bits per index,

  - ``<module>.sparse_index_lower``: uint8, the low ℓ bits of every index, ηⱼ mod 2^ℓ, packed back to back
    (index j in bits jℓ … jℓ+ℓ−1 of the byte string, least significant bit first): ⌈nℓ/8⌉ bytes;
  - ``<module>.sparse_index_upper``: uint8, a bit string with bit ``(ηⱼ >> ℓ) + j`` set for every j — the
    high parts in unary, as gaps — ⌈(n + ((N − 1) >> ℓ))/8⌉ bytes (none when n = 0);
  - ``<module>.sparse_index_header``: int64 ``[N, n, ℓ]``.

  Decoding is three vectorised steps: the positions pⱼ of the set bits of the upper string give
  ηⱼ >> ℓ = pⱼ − j, the lower string gives the low bits, ηⱼ = ((pⱼ − j) << ℓ) | lowⱼ. ℓ ≈ log2(N/n) (the
  exact size is computed for a few ℓ and the smallest taken), so the code costs about n·(2 + log2(N/n))
  bits. The information in a uniformly random choice of n positions out of N is log2 C(N, n) ≈
  n·(log2(N/n) + 1.44) bits for n ≪ N; Elias–Fano stays within 1.2× of it from density 0.1% to 20% (1.09×
  at the 4.6% of LoRA r16's budget on SmolLM2-135M; tensors of a million weights, its 24-byte header
  included). From density 1/4 on the bitmap is smaller and ``"auto"`` takes it, so "auto" stays within
  1.25× of log2 C(N, n) up to density 1/2 (above, fewer positions are free than taken, and no form here
  codes the free ones).

A reader without peft_sparse, in numpy::

    N, n, l = header
    bits = np.unpackbits(upper, bitorder="little")
    high = np.flatnonzero(bits)[:n] - np.arange(n)
    low_bits = np.unpackbits(lower, bitorder="little")[: n * l].reshape(n, l).astype(np.int64)
    indices = (high << l) | (low_bits << np.arange(l)).sum(1)

**Values.** ``<module>.sparse_values``: one number per index, in index order, in the adapter's
``values_dtype`` (the config's) or the dtype asked for at saving (``save_pretrained(..., values_dtype=...)``,
:func:`cast_values`). A cast that cannot hold every value (float32 → bfloat16, say) is refused unless
``allow_lossy_cast=True``; an exact widening (bfloat16 → float32) is always made.

**Ages.** SpIEL keeps, per index, the optimizer step at which it was last grown (``sparse_ages``, 0 for
the initial indices): a training diagnostic (thesis Fig. 7.4). It is not part of the delta, and as int32
it would cost as much as float32 values, so a saved adapter holds it only when asked
(``save_pretrained(..., save_ages=True)``), then in the narrowest integer dtype that holds the run's
largest step (uint8 below 256 steps, int16 below 32,768, else int32). Exact resume does not depend on
it: the SpIEL scheduler's checkpoint state (written into every Trainer checkpoint beside the adapter)
holds the ages. An adapter loaded without ages starts them at 0 — every index counts as initial —
also for training on.

Loading accepts every form, including files of the earlier format (lists or bitmaps, int32 ages);
everything that reads adapter files (PEFT loading, ``merge_sparse_adapters``, ``peft-sparse inspect``)
goes through :func:`decode`, and reads the file through :func:`read_tensors` or :func:`reading`, which name
a damaged file instead of passing on safetensors' bare header error.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from .base import index_dtype

WEIGHTS_FILE = "adapter_model.safetensors"


@contextmanager
def reading(path):
    """Turn safetensors' errors while reading ``path`` (e.g. "Error while deserializing header: invalid JSON in
    header") into a ValueError that names the file and says what is wrong with it."""
    from safetensors import SafetensorError

    try:
        yield
    except SafetensorError as exc:
        raise ValueError(
            f"{os.fspath(path)} is damaged or incomplete: it is not a readable safetensors file ({exc}); "
            "save the adapter again or copy it again from where it was saved"
        ) from None


def weights_path(adapter_dir) -> str:
    """The adapter directory's ``adapter_model.safetensors``; a clear error when it is missing."""
    path = os.path.join(adapter_dir, WEIGHTS_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{os.fspath(adapter_dir)} holds no {WEIGHTS_FILE}")
    return path


def read_tensors(adapter_dir, device: str = "cpu") -> dict:
    """Every tensor of the adapter directory's ``adapter_model.safetensors``, as stored (see :func:`decode`)."""
    from safetensors.torch import load_file

    path = weights_path(adapter_dir)
    with reading(path):
        return load_file(path, device=device)


LIST, BITS = ".sparse_indices", ".sparse_index_bits"
UPPER, LOWER, HEADER = ".sparse_index_upper", ".sparse_index_lower", ".sparse_index_header"
AGES = ".sparse_ages"
CHOICES = ("auto", "list", "bitmap", "elias-fano")
#: the longest run of lower bits one index may have (a field is read as one 64-bit word, after a shift of ≤ 7)
MAX_LOWER_BITS = 56


# ---------------------------------------------------------------------------------------------- bit strings
def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """A 1-D bool/0-1 tensor → uint8 bytes, bit i of byte j holding element 8j + i (zero-padded)."""
    pad = (-bits.numel()) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    weights = (1 << torch.arange(8, device=bits.device, dtype=torch.uint8))
    return (bits.view(-1, 8).to(torch.uint8) * weights).sum(-1, dtype=torch.uint8)


def _set_bit_positions(data: torch.Tensor) -> torch.Tensor:
    """uint8 bytes → ascending int64 positions of their set bits (least significant bit first).

    On the CPU numpy finds them (``unpackbits`` + ``flatnonzero`` over booleans: several times faster than
    ``torch.nonzero``, which dominates decoding otherwise); elsewhere torch does."""
    if data.device.type == "cpu":
        bits = np.unpackbits(data.numpy(), bitorder="little").view(np.bool_)
        return torch.from_numpy(np.flatnonzero(bits).astype(np.int64, copy=False))
    weights = 1 << torch.arange(8, device=data.device, dtype=torch.uint8)
    return torch.nonzero((data.unsqueeze(-1) & weights).view(-1)).view(-1)


def pack(indices: torch.Tensor, numel: int) -> torch.Tensor:
    """Sorted flat indices of an ``numel``-weight tensor → its bitmap, (⌈numel/8⌉,) uint8."""
    bits = torch.zeros(math.ceil(numel / 8) * 8, dtype=torch.bool, device=indices.device)
    bits[indices.long()] = True
    return _pack_bits(bits)


def unpack(bitmap: torch.Tensor, dtype: torch.dtype, where: str = "") -> torch.Tensor:
    """Bitmap → ascending flat indices of ``dtype``."""
    if bitmap.dtype != torch.uint8 or bitmap.dim() != 1:
        raise ValueError(f"{where}: a bitmap of positions must be 1-D uint8, got {bitmap.dtype} {tuple(bitmap.shape)}")
    return _set_bit_positions(bitmap).to(dtype)


def _pack_fields(fields: torch.Tensor, width: int) -> torch.Tensor:
    """Non-negative int64 values below 2^width → their low ``width`` bits back to back, (⌈n·width/8⌉,) uint8."""
    if width == 0 or fields.numel() == 0:
        return torch.zeros(0, dtype=torch.uint8, device=fields.device)
    shifts = torch.arange(width, device=fields.device, dtype=torch.int64)
    bits = ((fields.unsqueeze(1) >> shifts) & 1).to(torch.bool)  # (n, width)
    return _pack_bits(bits.reshape(-1))


def _unpack_fields(data: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """Inverse of :func:`_pack_fields`: ``count`` int64 values of ``width`` bits.

    Every 8 fields fill exactly ``width`` bytes, so the bytes are laid out as rows of 8 fields, each row
    zero-padded to ⌈width/8⌉ little-endian 64-bit words. Field i of every row starts at the same bit
    b = i·width of its row: it is word b >> 6 shifted right by b mod 64, joined with the low bits of the next
    word where it straddles two, and masked. The fields that lie in one word are shifted out of it in one
    broadcast operation (all 8 of them for width ≤ 8): a few operations over all rows, nothing per field."""
    device = data.device
    if width == 0 or count == 0:
        return torch.zeros(count, dtype=torch.int64, device=device)
    rows, words = math.ceil(count / 8), math.ceil(width / 8)
    table = torch.zeros(rows, 8 * words, dtype=torch.uint8, device=device)
    full = min(rows, data.numel() // width)  # (the last row may be short)
    table[:full, :width] = data[: full * width].view(full, width)
    if full < rows:
        rest = data[full * width :]
        table[full, : rest.numel()] = rest
    if sys.byteorder == "little":
        table = table.view(torch.int64)  # (rows, words)
    else:
        table = (table.view(rows, words, 8).to(torch.int64) << (torch.arange(8, device=device) * 8)).sum(-1)
    out = torch.empty(rows, 8, dtype=torch.int64, device=device)
    i = 0
    while i < 8:
        word, shift = divmod(i * width, 64)
        if shift + width > 64:  # straddles words `word` and `word + 1` (arithmetic shift: drop the sign's copies)
            field = torch.bitwise_right_shift(table[:, word], shift, out=out[:, i]).bitwise_and_((1 << (64 - shift)) - 1)
            field.bitwise_or_(table[:, word + 1] << (64 - shift))
            i += 1
            continue
        end = i + 1  # fields i … end − 1 lie in this word
        while end < 8 and (end * width) // 64 == word and (end * width) % 64 + width <= 64:
            end += 1
        shifts = torch.tensor([(k * width) % 64 for k in range(i, end)], device=device)
        torch.bitwise_right_shift(table[:, word : word + 1], shifts, out=out[:, i:end])
        i = end
    return out.bitwise_and_((1 << width) - 1).view(-1)[:count]


# ---------------------------------------------------------------------------------------------- Elias–Fano
def elias_fano_size(count: int, numel: int, lower_bits: int) -> int:
    """Bytes of the upper and lower bit strings of ``count`` indices of an ``numel``-weight tensor."""
    if count == 0:
        return 0
    upper = count + ((numel - 1) >> lower_bits)  # (the last set bit is at most (numel − 1 >> ℓ) + count − 1)
    return math.ceil(upper / 8) + math.ceil(count * lower_bits / 8)


def elias_fano_lower_bits(count: int, numel: int) -> int:
    """ℓ of the smallest code: ⌊log2(N/n)⌋ and its neighbours tried exactly."""
    if count == 0:
        return 0
    guess = max(0, int(math.floor(math.log2(max(numel, 1) / count))))
    options = [l for l in (guess - 1, guess, guess + 1) if 0 <= l <= MAX_LOWER_BITS]
    return min(options, key=lambda l: (elias_fano_size(count, numel, l), l))


def elias_fano_encode(indices: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sorted unique flat indices → (upper, lower, header) as stored (module docstring)."""
    indices = indices.long()
    count = indices.numel()
    width = elias_fano_lower_bits(count, numel)
    header = torch.tensor([numel, count, width], dtype=torch.int64)
    if count == 0:
        empty = torch.zeros(0, dtype=torch.uint8, device=indices.device)
        return empty, empty.clone(), header
    positions = (indices >> width) + torch.arange(count, device=indices.device)
    upper_bits = torch.zeros(count + ((numel - 1) >> width), dtype=torch.bool, device=indices.device)
    upper_bits[positions] = True
    lower = _pack_fields(indices & ((1 << width) - 1), width)
    return _pack_bits(upper_bits), lower, header


def elias_fano_decode(upper: torch.Tensor, lower: torch.Tensor, header: torch.Tensor, where: str = "") -> torch.Tensor:
    """(upper, lower, header) → the sorted indices, int32 below 2³¹ weights (else int64)."""
    if header.numel() != 3 or header.dtype != torch.int64:
        raise ValueError(f"{where}: an Elias–Fano header must be int64 [numel, count, lower_bits], got {header.dtype} {tuple(header.shape)}")
    numel, count, width = (int(v) for v in header.tolist())
    if numel < 0 or count < 0 or count > numel or not 0 <= width <= MAX_LOWER_BITS:
        raise ValueError(f"{where}: invalid Elias–Fano header numel={numel}, count={count}, lower_bits={width}")
    if upper.dtype != torch.uint8 or lower.dtype != torch.uint8 or upper.dim() != 1 or lower.dim() != 1:
        raise ValueError(f"{where}: Elias–Fano bit strings must be 1-D uint8, got {upper.dtype} {tuple(upper.shape)} and {lower.dtype} {tuple(lower.shape)}")
    if upper.numel() != (math.ceil((count + ((numel - 1) >> width)) / 8) if count else 0):
        raise ValueError(f"{where}: {upper.numel()} bytes of upper bits, expected {elias_fano_size(count, numel, width) - math.ceil(count * width / 8)} for {count} indices of {numel}")
    if lower.numel() != math.ceil(count * width / 8):
        raise ValueError(f"{where}: {lower.numel()} bytes of lower bits, expected {math.ceil(count * width / 8)} for {count} indices of {width} bits")
    positions = _set_bit_positions(upper)
    if positions.numel() != count:
        raise ValueError(f"{where}: the upper bit string marks {positions.numel()} indices, the header says {count}")
    indices = positions.sub_(torch.arange(count, device=upper.device)).bitwise_left_shift_(width)  # the high parts
    indices.bitwise_or_(_unpack_fields(lower, count, width))
    return indices.to(index_dtype(numel))


def entropy_bits(count: int, numel: int) -> float:
    """log2 C(numel, count): the bits that tell one choice of ``count`` positions out of ``numel`` from all others."""
    return (math.lgamma(numel + 1) - math.lgamma(count + 1) - math.lgamma(numel - count + 1)) / math.log(2)


# ---------------------------------------------------------------------------------------------- the choice
def storage_bytes(count: int, numel: int, index_bytes: int) -> dict[str, int]:
    """Bytes each form takes for ``count`` positions of an ``numel``-weight tensor (Elias–Fano with its header)."""
    return {
        "list": count * index_bytes,
        "bitmap": math.ceil(numel / 8),
        "elias-fano": elias_fano_size(count, numel, elias_fano_lower_bits(count, numel)) + 24,
    }


def choose(count: int, numel: int, index_bytes: int, storage: str) -> str:
    """The form a tensor's positions are saved in: ``storage`` itself, or for "auto" the smallest (ties: the
    first of list, bitmap, elias-fano)."""
    if storage != "auto":
        return storage
    sizes = storage_bytes(count, numel, index_bytes)
    return min(sizes, key=lambda form: sizes[form])


def use_bitmap(count: int, numel: int, index_bytes: int, storage: str) -> bool:
    return choose(count, numel, index_bytes, storage) == "bitmap"


def _is_list_key(key: str) -> bool:
    return LIST + "." in key or key.endswith(LIST)


def encode(state_dict: dict, numel_of, storage: str) -> dict:
    """Replace each ``…sparse_indices…`` entry of a state dict by the form ``storage`` says (module docstring).
    ``numel_of(key)`` gives the weight count of the tensor an index entry belongs to."""
    if storage not in CHOICES:
        raise ValueError(f"index_storage must be one of {CHOICES}, got index_storage={storage!r}")
    out = {}
    for key, value in state_dict.items():
        if not _is_list_key(key):
            out[key] = value
            continue
        numel = numel_of(key)
        form = choose(value.numel(), numel, value.element_size(), storage)
        if form == "bitmap":
            out[key.replace(LIST, BITS, 1)] = pack(value, numel)
        elif form == "elias-fano":
            upper, lower, header = elias_fano_encode(value, numel)
            out[key.replace(LIST, UPPER, 1)] = upper
            out[key.replace(LIST, LOWER, 1)] = lower
            out[key.replace(LIST, HEADER, 1)] = header
        else:
            out[key] = value
    return out


def decode(state_dict: dict) -> dict:
    """Every stored form of positions back into its ``…sparse_indices…`` list (int32 below 2³¹ weights)."""
    out = {}
    for key, value in state_dict.items():
        if BITS in key:
            dtype = torch.int32 if value.numel() * 8 <= 2**31 else torch.int64
            out[key.replace(BITS, LIST, 1)] = unpack(value, dtype, key.replace(BITS, "", 1).removeprefix("base_model.model."))
        elif HEADER in key:
            upper_key, lower_key = key.replace(HEADER, UPPER, 1), key.replace(HEADER, LOWER, 1)
            where = key.replace(HEADER, "", 1).removeprefix("base_model.model.")
            if upper_key not in state_dict or lower_key not in state_dict:
                raise ValueError(f"{where}: the adapter file holds an Elias–Fano header but not both bit strings")
            out[key.replace(HEADER, LIST, 1)] = elias_fano_decode(state_dict[upper_key], state_dict[lower_key], value, where)
        elif UPPER in key or LOWER in key:
            if key.replace(UPPER, HEADER, 1).replace(LOWER, HEADER, 1) not in state_dict:
                where = key.replace(UPPER, "", 1).replace(LOWER, "", 1).removeprefix("base_model.model.")
                raise ValueError(f"{where}: the adapter file holds an Elias–Fano bit string but no header")
        else:
            out[key] = value
    return out


def storage_form(state_dict: dict, list_key: str) -> str:
    """The form in which a raw (undecoded) adapter state dict stores the positions of ``list_key``."""
    if list_key.replace(LIST, BITS, 1) in state_dict:
        return "bitmap"
    if list_key.replace(LIST, HEADER, 1) in state_dict:
        return "elias-fano"
    return "list"


# ---------------------------------------------------------------------------------------------- saving options
@dataclass(frozen=True)
class SaveOptions:
    """What ``save_pretrained`` was asked for beyond PEFT's own arguments (set for the duration of the call)."""

    values_dtype: Optional[torch.dtype] = None  # None: each adapter's config values_dtype
    allow_lossy_cast: bool = False
    save_ages: bool = False


_SAVE_OPTIONS: contextvars.ContextVar[SaveOptions] = contextvars.ContextVar("peft_sparse_save_options", default=SaveOptions())


@contextlib.contextmanager
def save_options(**options):
    """Within the block, sparse adapters are saved with these :class:`SaveOptions`."""
    token = _SAVE_OPTIONS.set(SaveOptions(**options))
    try:
        yield
    finally:
        _SAVE_OPTIONS.reset(token)


def current_save_options() -> SaveOptions:
    return _SAVE_OPTIONS.get()


#: casts that hold every value of the source dtype
EXACT_CASTS = {
    torch.float16: (torch.float16, torch.float32, torch.float64),
    torch.bfloat16: (torch.bfloat16, torch.float32, torch.float64),
    torch.float32: (torch.float32, torch.float64),
    torch.float64: (torch.float64,),
}


def dtype_label(dtype: Optional[torch.dtype]) -> Optional[str]:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def cast_values(values: torch.Tensor, dtype: torch.dtype, allow_lossy: bool, what: str, asked: str) -> torch.Tensor:
    """``values`` in ``dtype`` for the file: an exact cast always, a lossy one only with ``allow_lossy``.

    ``what`` names the tensor, ``asked`` the setting that asked for ``dtype`` (for the error)."""
    if values.dtype == dtype:
        return values
    if dtype not in EXACT_CASTS.get(values.dtype, ()) and not allow_lossy:
        raise ValueError(
            f"{asked} would save the {values.dtype} values of {what} as {dtype}, which cannot hold every "
            f"{values.dtype} value; pass save_pretrained(..., allow_lossy_cast=True) to round them, or save them in "
            f"{str(values.dtype).removeprefix('torch.')} (save_pretrained(..., values_dtype={str(values.dtype).removeprefix('torch.')!r}))"
        )
    return values.to(dtype)


def narrow_ages(ages: torch.Tensor) -> torch.Tensor:
    """Ages (optimizer steps, ≥ 0) in the narrowest of uint8, int16, int32 that holds the largest."""
    largest = int(ages.max()) if ages.numel() else 0
    for dtype in (torch.uint8, torch.int16):
        if largest <= torch.iinfo(dtype).max:
            return ages.to(dtype)
    return ages.to(torch.int32)


def widen_ages(ages: torch.Tensor, count: int, where: str) -> torch.Tensor:
    """Saved ages (any of the dtypes :func:`narrow_ages` writes, or the earlier int32) → int32, checked."""
    if ages.dtype not in (torch.uint8, torch.int16, torch.int32) or ages.dim() != 1 or ages.numel() != count:
        raise ValueError(
            f"{where}: ages must be {count} integers (uint8, int16 or int32), one per index, got {ages.dtype} {tuple(ages.shape)}"
        )
    if ages.numel() and int(ages.min()) < 0:
        raise ValueError(f"{where}: ages are optimizer steps and cannot be negative, found {int(ages.min())}")
    return ages.to(torch.int32)
