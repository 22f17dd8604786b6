"""Vision-language models: images in prompts (LMDeploy's `llmserve.vl.load_image`, `IMAGE_TOKEN`)."""

from llmserve.vl.constants import IMAGE_TOKEN
from llmserve.vl.image import load_image

__all__ = ["IMAGE_TOKEN", "load_image"]
