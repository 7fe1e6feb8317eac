"""Media the M* encoder tests make themselves, so a clone without ``../shared`` runs them all: PNG images
(``conftest.png_bytes``: seeded RGB noise), WAVs in Seed-TTS's reference-voice format (``workloads.models.voice_clone.
tone_wav``: 24 kHz mono 16-bit, a vibrato tone over a chirp and noise, 1.3-2.7 s, distinct per voice) and
text-to-video prompts as strings. The same call writes the same bytes."""

from pathlib import Path

from conftest import png_bytes

# image sizes (width, height) in the spirit of MMMU's: non-square, some larger than the tiny processors' pixel cap
IMAGE_SIZES = ((160, 120), (96, 64), (200, 150), (64, 80))
PROMPTS = ("a lighthouse on a cliff at dawn, oil painting", "a red fox in fresh snow, photograph, 85mm",
           "isometric city block at night, neon signs, rain", "a bowl of ramen, steam rising, studio lighting",
           "an astronaut riding a horse on the moon, digital art", "watercolor of a quiet harbor with small boats",
           "a steampunk owl made of brass gears, intricate detail", "sunflowers in a field under a stormy sky",
           "a cozy reading nook with a cat asleep on a blanket", "low poly mountains reflected in a lake",
           "portrait of an old fisherman, charcoal sketch", "a glass terrarium holding a tiny forest")
NEGATIVE = "blurry, low quality, distorted, watermark, text"


def images(folder: Path, sizes=IMAGE_SIZES) -> list[Path]:
    """One PNG per size, written under ``folder`` (different pixels per file)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, size in enumerate(sizes):
        paths.append(folder / f"image-{i}-{size[0]}x{size[1]}.png")
        paths[-1].write_bytes(png_bytes(100 + i, size))
    return paths


def voices(folder: Path, n: int = 3) -> list[Path]:
    """``n`` reference-voice WAVs written under ``folder``, one per speaker."""
    from workloads.models.voice_clone import tone_wav
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for speaker in range(n):
        paths.append(folder / f"voice-{speaker}.wav")
        paths[-1].write_bytes(tone_wav(speaker))
    return paths


def voice_rows(folder: Path, n: int = 3) -> list[Path]:
    """The reference WAV of each row of a Seed-TTS-style list, in order: every voice serves two rows."""
    return [wav for wav in voices(folder, n) for _ in range(2)]
