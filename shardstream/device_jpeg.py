"""Decoding JPEGs on the device: workers ship the encoded bytes, the GPU decodes the batch.

On a machine whose CPUs cannot decode as fast as the GPU trains, the decode moves to
the GPU (nvJPEG, through ``torchvision.io.decode_jpeg(..., device="cuda")``). The work
splits in two, and each half keeps the guarantees of the CPU path:

* **In the workers**, `DeferDecode` wraps a fused transform (`RandomResizedCropJPEG`,
  `CenterCropJPEG`) and draws its crop and flip from the JPEG header alone, from the same
  per-sample seed, so augmentation stays reproducible and resume exact. It returns an
  `EncodedImage`: the bytes plus that plan. The dataset's default collate packs a batch
  of them into one `EncodedBatch` (all bytes in one tensor: one message between
  processes, one pinned buffer); where torch's DataLoader makes the batches, pass it
  ``collate_fn=shardstream.default_collate``.
* **On the device**, `DecodeOnDevice` (a `transform_on_device` for
  `shardstream.DataLoader`) decodes the batch, crops, resizes (antialiased bilinear) and
  mirrors each image, and stacks them: uint8 ``(N, 3, H, W)`` on the device, the same
  layout the CPU transform gives, ready for `Normalize`.

Where CUDA or torchvision's GPU decoder is missing, `DecodeOnDevice` decodes on the
CPU with the CPU transform's own code (`transforms.crop_resize`), so the same pipeline
runs anywhere and gives exactly the CPU transform's pixels there. On the GPU the pixels
differ slightly (nvJPEG's IDCT and upsampling, a float resize): `tools/gpu_check.py`
measures by how much. torchvision 0.29 deprecates its image decoders in favour of
TorchCodec's; the GPU path here uses torchvision's, which the torch release it pairs
with still ships. Images that are not JPEGs (PNG, WebP) are decoded on the CPU there.

What moves with the decode: an image that fails to decode is found in the main process,
after batching, so it raises (a `DecodeError` naming its place in the batch; nvJPEG
fails the whole batch, and the CPU decoder then finds the culprit, or decodes the batch
when nvJPEG merely does not support one of its images) rather than being
skipped under the dataset's `on_error` policy, which sees only the workers' side.
`shardstream verify` names the sample.
"""

from __future__ import annotations

import functools
import io
import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Protocol, Sequence

import torch
import torch.nn.functional as F
from PIL import Image

from .batches import map_field, usable_device
from .decode import DAMAGED_IMAGE_ERRORS, is_jpeg
from .errors import DecodeError
from .transforms import CropPlan, crop_resize

__all__ = ["DeferDecode", "EncodedImage", "EncodedBatch", "DecodeOnDevice", "collate_encoded", "decode_then_crop",
           "gpu_decoder_available"]


class _PlansCrops(Protocol):
    def plan(self, data: bytes) -> CropPlan: ...


@dataclass(frozen=True)
class EncodedImage:
    """One image's encoded bytes and the crop to take of it once decoded."""

    data: bytes
    plan: CropPlan


@dataclass(frozen=True)
class EncodedBatch:
    """A batch of encoded images: every image's bytes back to back, and the plans."""

    data: torch.Tensor  # uint8, 1-D: all images' bytes
    offsets: tuple[int, ...]  # image i is data[offsets[i]:offsets[i + 1]]
    plans: tuple[CropPlan, ...]

    def __len__(self) -> int:
        return len(self.plans)

    def encoded(self) -> list[torch.Tensor]:
        """Each image's bytes, as 1-D uint8 views of `data`."""
        return [self.data[a:b] for a, b in zip(self.offsets[:-1], self.offsets[1:])]

    def pin_memory(self) -> EncodedBatch:
        """Called by the DataLoader's pinning thread: the bytes go to page-locked memory."""
        return replace(self, data=self.data.pin_memory())


def collate_encoded(images: list[EncodedImage]) -> EncodedBatch:
    """Pack `EncodedImage`s into one `EncodedBatch` (one copy of the bytes)."""
    offsets = [0]
    for image in images:
        offsets.append(offsets[-1] + len(image.data))
    joined = bytearray().join(image.data for image in images)
    data = torch.frombuffer(joined, dtype=torch.uint8) if joined else torch.empty(0, dtype=torch.uint8)
    return EncodedBatch(data, tuple(offsets), tuple(image.plan for image in images))


@dataclass(frozen=True)
class DeferDecode:
    """Worker side: image bytes -> `EncodedImage`, with `transform`'s crop drawn but not taken.

    `transform` is a fused transform with a ``plan(data)`` method (`RandomResizedCropJPEG`,
    `CenterCropJPEG`); only the image header is read here.
    """

    transform: _PlansCrops

    def __post_init__(self) -> None:
        if not callable(getattr(self.transform, "plan", None)):
            raise TypeError(f"DeferDecode needs a fused transform with a plan(data) method "
                            f"(RandomResizedCropJPEG, CenterCropJPEG), not {self.transform!r}")

    def __call__(self, data: bytes, generator: torch.Generator | None = None) -> EncodedImage:
        """`data` with its crop drawn from `generator` (the dataset's, seeded per sample,
        where `transform` is one of ours; a planner of the user's is called as `plan(data)`)."""
        plan = self.transform.plan(data) if generator is None else self.transform.plan(data, generator)
        return EncodedImage(bytes(data), plan)


def gpu_decoder_available(device: str | torch.device = "cuda") -> bool:
    """Whether torchvision's nvJPEG decoder runs on `device`: tried once per device on a
    tiny JPEG, since torchvision may import and still lack its image ops or nvJPEG."""
    device = torch.device(device)
    if device.type != "cuda" or _torchvision_decode_jpeg() is None or not torch.cuda.is_available():
        return False
    return _decodes_on(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _torchvision_decode_jpeg() -> Callable[..., Any] | None:
    try:
        from torchvision.io import decode_jpeg
    except Exception:  # not installed, or built against another torch: its ops fail to load
        return None
    return decode_jpeg


@functools.cache
def _decodes_on(index: int) -> bool:
    decode_jpeg = _torchvision_decode_jpeg()
    probe = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 30, 30)).save(probe, "JPEG")
    try:
        decoded = decode_jpeg([torch.frombuffer(bytearray(probe.getvalue()), dtype=torch.uint8)], mode="RGB",
                              device=torch.device("cuda", index))
        return tuple(decoded[0].shape) == (3, 16, 16)
    except Exception as e:  # no nvJPEG, ops that failed to load, a driver too old: the CPU decodes
        warnings.warn(f"torchvision's GPU JPEG decoder does not run on cuda:{index} ({type(e).__name__}: {e}); "
                      "DecodeOnDevice decodes on the CPU", RuntimeWarning, stacklevel=3)
        return False


@functools.cache
def _decode_stream(index: int) -> torch.cuda.Stream:
    """The stream nvJPEG decodes under, on device `index`, used for nothing else.

    torchvision allocates the decoded images on the current stream and nvJPEG writes them
    from a stream of its own that does not wait for it (pytorch/vision#9606): under the
    loader's copy stream, a block freed there by the previous batch's still-queued kernels
    could be overwritten early. Under this stream, whose every output is handed on with
    `record_stream`, no block is reused before the kernels that read it are done.
    """
    return torch.cuda.Stream(device=index)


@dataclass(frozen=True)
class DecodeOnDevice:
    """Device side, a `transform_on_device`: `EncodedBatch` -> uint8 (N, 3, H, W) on `device`.

    `field` picks the encoded batch in a tuple (an index) or dict (a key) batch; a bare
    `EncodedBatch` is decoded itself. On a CUDA device with torchvision's GPU decoder
    the batch is decoded by nvJPEG in one call; anywhere else on the CPU, exactly as
    the fused CPU transform does, then moved to `device` (left on the CPU, with a
    warning, where `device` is CUDA and this machine has none).
    """

    device: str | torch.device = "cuda"
    field: int | str = 0

    @property
    def on_gpu(self) -> bool:
        """Whether batches will be decoded by nvJPEG (else on the CPU)."""
        return gpu_decoder_available(self.device)

    def decode(self, batch: EncodedBatch) -> torch.Tensor:
        if not isinstance(batch, EncodedBatch):
            raise TypeError(f"DecodeOnDevice decodes the EncodedBatch a dataset with decode=DeferDecode(...) "
                            f"makes; field {self.field!r} of this batch is a {type(batch).__name__}")
        if self.on_gpu:
            return _decode_gpu(batch, torch.device(self.device))
        target = _target(self.device)
        # Asynchronously to CUDA only: the decoded batch is let go of at once, and on Apple's GPU
        # ("mps") a copy still reading released memory gave wrong values, silently (pytorch#189690).
        return _decode_cpu(batch, range(len(batch))).to(target, non_blocking=target.type == "cuda")

    def __call__(self, batch: Any) -> Any:
        if isinstance(batch, EncodedBatch):
            return self.decode(batch)
        return map_field(batch, self.field, self.decode)


# Where CPU-decoded batches go: `device`, or the CPU where it is CUDA and there is none
# (warned about once per device, not per batch).
_target = functools.lru_cache(maxsize=8)(usable_device)


def _decode_cpu(batch: EncodedBatch, which: Iterable[int]) -> torch.Tensor:
    """Images `which` of the batch decoded and cropped on the CPU, as the fused transform does."""
    encoded, out = batch.encoded(), []
    for i in which:
        try:
            out.append(crop_resize(bytes(memoryview(encoded[i].numpy())), batch.plans[i]))
        except DAMAGED_IMAGE_ERRORS as e:
            raise DecodeError(f"image {i} of a batch of {len(batch)} ({len(encoded[i])} bytes) cannot be decoded: {e}; "
                              "`shardstream verify` names the sample") from e
    return torch.stack(out)


def _decode_gpu(batch: EncodedBatch, device: torch.device) -> torch.Tensor:
    jpegs = [i for i, t in enumerate(batch.encoded()) if is_jpeg(t[:2].numpy())]
    try:
        return decode_then_crop(batch, lambda encoded: _nvjpeg(encoded, device), jpegs,
                                lambda others: _decode_cpu(batch, others).to(device, non_blocking=True))
    except torch.cuda.OutOfMemoryError:
        raise  # the device's memory, not nvJPEG's refusal: decoding on the CPU would hide it
    except RuntimeError as e:
        # nvJPEG refuses a whole batch for one image it cannot take: a damaged one (the
        # CPU decoder then raises, naming it), or a valid one it does not support (CMYK,
        # arithmetic coding, some subsamplings), which the CPU decodes.
        out = _decode_cpu(batch, range(len(batch))).to(device, non_blocking=True)
        _warn_once(f"nvJPEG refused a batch ({e}); it was decoded on the CPU")
        return out


def _nvjpeg(encoded: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """`encoded` decoded by nvJPEG under its own stream (`_decode_stream`), ready for the caller's stream."""
    decode_jpeg = _torchvision_decode_jpeg()
    assert decode_jpeg is not None
    caller = torch.cuda.current_stream(device)
    stream = _decode_stream(device.index if device.index is not None else torch.cuda.current_device())
    stream.wait_stream(caller)
    with torch.cuda.stream(stream):
        images = decode_jpeg(encoded, mode="RGB", device=device)
    caller.wait_stream(stream)
    for image in images:
        image.record_stream(caller)  # read by the crops queued on the caller's stream
    return images


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=4)


def decode_then_crop(batch: EncodedBatch, decode_all: Callable[[list[torch.Tensor]], list[torch.Tensor]],
                     jpegs: Sequence[int] | None = None,
                     decode_others: Callable[[list[int]], torch.Tensor] | None = None) -> torch.Tensor:
    """Decode the batch's JPEGs (`jpegs`, default all) in one call of `decode_all` (1-D
    uint8 byte tensors to uint8 CHW images, on whatever device it decodes to; nvJPEG's
    batched decode on the GPU), then take each image's crop there; the other images
    (PNG, WebP, ...) come from `decode_others`, already cropped. uint8 (N, 3, H, W)."""
    jpegs = list(range(len(batch))) if jpegs is None else list(jpegs)
    encoded = batch.encoded()
    decoded = decode_all([encoded[i] for i in jpegs]) if jpegs else []
    out: list[torch.Tensor | None] = [None] * len(batch)
    for i, image in zip(jpegs, decoded):
        out[i] = _crop_resize_tensor(image, batch.plans[i])
    others = [i for i in range(len(batch)) if out[i] is None]
    if others:
        if decode_others is None:
            raise ValueError(f"images {others} of the batch are not JPEGs and no other decoder was given")
        for i, image in zip(others, decode_others(others)):
            out[i] = image
    return torch.stack(out)  # type: ignore[arg-type]


def _crop_resize_tensor(image: torch.Tensor, plan: CropPlan) -> torch.Tensor:
    """`plan` applied to a decoded uint8 CHW image, on its device: uint8 CHW."""
    if plan.resized_first:  # CenterCropJPEG: the whole image resized, then the crop (as torchvision's tensors)
        sy, sx = plan.box[2] / plan.size[1], plan.box[3] / plan.size[0]
        resized_hw = (round(plan.full[1] / sy), round(plan.full[0] / sx))
        top, left = round(plan.box[0] / sy), round(plan.box[1] / sx)
        resized = F.interpolate(image.unsqueeze(0).float(), size=resized_hw, mode="bilinear", antialias=True)[0]
        out = resized[:, top : top + plan.size[1], left : left + plan.size[0]]
    else:  # RandomResizedCrop's order: the crop (whole pixels), then the resize
        top, left, h, w = (int(v) for v in plan.box)
        region = image[:, top : top + h, left : left + w].unsqueeze(0).float()
        out = F.interpolate(region, size=(plan.size[1], plan.size[0]), mode="bilinear", antialias=True)[0]
    if plan.flip:
        out = out.flip(-1)
    return out.round_().clamp_(0, 255).to(torch.uint8)
