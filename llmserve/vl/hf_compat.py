"""Loading transformers' multimodal processors on a machine without torchvision.

transformers' video processors are built on torchvision, and several VLM processors (InternVL, SmolVLM, Qwen2-VL)
take one as a required part, so without torchvision (CPU-only machines where no torchvision wheel matching the
installed torch exists) neither `AutoProcessor.from_pretrained` nor the processor's constructor works, even for
images. llmserve serves images only; `without_video_processor()` lets these processors be built and loaded with no
video processor (None) while it is active. Videos sent to such a processor then fail inside transformers, and
llmserve never sends any.
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()


def has_torchvision() -> bool:
    return importlib.util.find_spec("torchvision") is not None


@contextmanager
def without_video_processor() -> Iterator[None]:
    """Within: processors accept video_processor=None or a NoVideoProcessor, and AutoVideoProcessor loads a
    NoVideoProcessor (without torchvision only; with it, nothing changes). Process-wide while active, so held under a lock."""
    if has_torchvision():
        yield
        return
    from transformers import processing_utils
    from transformers.processing_utils import ProcessorMixin

    original_check = ProcessorMixin.check_argument_for_proper_class
    autos = processing_utils.MODALITY_TO_AUTOPROCESSOR_MAPPING
    names = dict(autos._MAPPING_NAMES)
    names["video_processor"] = (__name__, "NoVideoProcessor")

    def check(self, argument_name, argument):  # type: ignore[no-untyped-def]
        if (argument is None or isinstance(argument, NoVideoProcessor)) and "video" in argument_name:
            return None
        return original_check(self, argument_name, argument)

    with _lock:
        ProcessorMixin.check_argument_for_proper_class = check
        autos._MAPPING_NAMES = names  # an instance attribute over the class's table
        try:
            yield
        finally:
            ProcessorMixin.check_argument_for_proper_class = original_check
            del autos._MAPPING_NAMES


class NoVideoProcessor(dict):
    """Stands in for a processor's video processor: every setting it is asked for is None (SmolVLM's chat template
    reads num_frames and fps from it), and it processes nothing. An empty dict, so that a processor holding it still
    prints and serializes."""

    @classmethod
    def from_pretrained(cls, *args: object, **kwargs: object) -> NoVideoProcessor:
        return cls()

    def __getattr__(self, name: str) -> None:
        if name.startswith("__"):
            raise AttributeError(name)
        return None

    def __call__(self, *args: object, **kwargs: object) -> None:
        raise ValueError("videos are not supported: llmserve serves text and images")


def save_processor(processor: object, directory: str) -> None:
    """processor.save_pretrained(directory), for a processor built without a video processor too."""
    cls = type(processor)
    video = getattr(processor, "video_processor", True)
    if video is not None and not isinstance(video, NoVideoProcessor):
        processor.save_pretrained(directory)  # type: ignore[attr-defined]
        return
    original = cls.__dict__.get("get_attributes")
    attributes = [a for a in cls.get_attributes() if "video" not in a]  # type: ignore[attr-defined]
    with _lock:
        cls.get_attributes = classmethod(lambda c: attributes)  # type: ignore[attr-defined]
        held = processor.__dict__.pop("video_processor")
        try:
            processor.save_pretrained(directory)  # type: ignore[attr-defined]
        finally:
            processor.__dict__["video_processor"] = held
            if original is None:
                del cls.get_attributes  # type: ignore[attr-defined]
            else:
                cls.get_attributes = original  # type: ignore[attr-defined]
