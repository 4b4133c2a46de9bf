"""Third-party notices that are noise for sharpclip, filtered once when `sharpclip.models` is imported."""

from __future__ import annotations

import logging


class _TorchvisionFallbackNotice(logging.Filter):
    """Drops transformers' "`CLIPImageProcessor` requires torchvision (not installed); falling back to
    `CLIPImageProcessorPil`" warning, printed first by every command on a machine without torchvision. It is noise
    here: sharpclip reads only the processor's settings (size, mean, std, interpolation, crop; models.preprocessing)
    and decodes and resizes with its own PIL transforms (data.transforms), so the backend transformers would have
    used changes no pixel. Every other transformers message passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "requires torchvision (not installed); falling back to" not in record.getMessage()


logging.getLogger("transformers.utils.import_utils").addFilter(_TorchvisionFallbackNotice())
