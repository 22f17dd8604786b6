"""LMDeploy's image placeholder: `pipe((f'describe this image{IMAGE_TOKEN}', image))` puts the image where the
token stands instead of before the text."""

IMAGE_TOKEN = "<IMAGE_TOKEN>"
