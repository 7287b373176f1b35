"""Gemma 3 / Gemma 4 multimodal classes (`*ForConditionalGeneration`) as their processors call them: token type ids
always present, images (bidirectional blocks) anywhere, the rings wrapped or not (trap 13).

Oracles: the no-cache forward (fp32, 1e-4) for logits, `DynamicCache` for generated tokens, and `DynamicCache` with
the same chunks where a chunk boundary falls inside an image block (no cache can show a query the keys of a later
chunk). Every scenario runs on both model families and on `sdpa`, `eager` and `banded` (`hybrid_cache_sdpa` with the
banded prefill from 2-token steps: builders.BANDED; its oracles keep transformers' dense masks).

Token types follow the processors: `token_type_ids` (Gemma 3) / `mm_token_type_ids` (Gemma 4), 1 on image
placeholder tokens, passed from position 0 (transformers reads them by absolute position: `generate` passes them up
to the chunk end, and so do these tests).
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from builders import (
    BANDED,
    BOI_ID,
    EOI_ID,
    IMAGE_ID,
    TEXT_IDS,
    random_images,
    reference_cache_kwargs,
    reference_masks,
    tiny_gemma3_multimodal,
    tiny_gemma4_multimodal,
)
from transformers import DynamicCache, GenerationMixin

from hybrid_cache import ConversationMismatchError, HybridRingCache, WindowMismatchError
from hybrid_cache.compat import CHUNKED_PREFILL_CONTINUES_SINCE, TRANSFORMERS_VERSION, cache_kwargs
from hybrid_cache.errors import PreparedMaskError

TOLERANCE = 1e-4
# Images are fed as pre-encoded `mm_encoder_outputs` (what `generate` passes per chunk), which transformers takes from
# 5.18; on older releases the no-cache oracle cannot be given the same image features.
needs_encoder_outputs = pytest.mark.skipif(
    not hasattr(GenerationMixin, "_supports_mm_encoder_outputs"),
    reason="this transformers release takes no `mm_encoder_outputs` (test_images_match_dynamic_cache runs instead)",
)
BUILDERS = {"gemma3": tiny_gemma3_multimodal, "gemma4": tiny_gemma4_multimodal}
TYPE_KEY = {"gemma3": "token_type_ids", "gemma4": "mm_token_type_ids"}


@pytest.fixture(params=["gemma3", "gemma4"])
def family(request) -> str:
    return request.param


@pytest.fixture(params=["sdpa", "eager", BANDED])
def attn(request) -> str:
    return request.param


def sequence(parts: list, tokens_per_image: int, seed: int) -> list[int]:
    """Token ids from parts: an int is that many random text tokens, "image" an image block (BOI, placeholders, EOI)."""
    rng = random.Random(seed)
    ids = []
    for part in parts:
        if part == "image":
            ids += [BOI_ID] + [IMAGE_ID] * tokens_per_image + [EOI_ID]
        else:
            ids += [rng.randint(*TEXT_IDS) for _ in range(part)]
    return ids


def left_pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(row)) + row for row in rows])
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])
    return ids, mask


class Scene:
    """A model, a (batch of) multimodal sequence(s) and its encoded images, with the oracle and chunked runs."""

    def __init__(self, family: str, attn: str, rows: list[list], window: int = 4, tokens_per_image: int = 4):
        self.family, self.type_key = family, TYPE_KEY[family]
        self.model = BUILDERS[family](window=window, attn=attn, tokens_per_image=tokens_per_image)
        self.ids, self.mask = left_pad([sequence(parts, tokens_per_image, seed) for seed, parts in enumerate(rows)])
        self.types = (self.ids == IMAGE_ID).long()
        images = int((self.ids == IMAGE_ID).sum()) // tokens_per_image
        self.features = None
        if images:
            with torch.no_grad():
                encoded = self.model.model.get_image_features(**random_images(self.model, images), return_dict=True)
            pooled = encoded.pooler_output
            self.features = torch.cat([f.reshape(-1, f.shape[-1]) for f in pooled])  # one row per placeholder
        # Feature row of every placeholder, in the (batch, sequence) order the model scatters them.
        self.rows = (self.ids == IMAGE_ID).flatten().cumsum(0).view_as(self.ids) - 1

    def encoder_outputs(self, start: int = 0, end: int | None = None) -> dict:
        """`mm_encoder_outputs` for the placeholders in columns `[start, end)` (what `generate` passes per chunk)."""
        chunk = self.ids[:, start:end]
        if self.features is None or not (chunk == IMAGE_ID).any():
            return {}
        features = self.features[self.rows[:, start:end][chunk == IMAGE_ID]]
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        pooled = features.unsqueeze(0) if self.family == "gemma3" else [features]
        return {"mm_encoder_outputs": {"image": BaseModelOutputWithPooling(pooler_output=pooled)}}

    @torch.no_grad()
    @reference_masks()
    def no_cache_logits(self) -> torch.Tensor:
        return self.model(
            input_ids=self.ids,
            attention_mask=self.mask,
            **reference_cache_kwargs(self.model),
            **{self.type_key: self.types},
            **self.encoder_outputs(),
        ).logits

    @torch.no_grad()
    def chunked_logits(self, cache, schedule: list[int]) -> torch.Tensor:
        outputs, position = [], 0
        for size in schedule:
            end = position + size
            outputs.append(
                self.model(
                    input_ids=self.ids[:, position:end],
                    attention_mask=self.mask[:, :end],
                    **cache_kwargs(cache),
                    **{self.type_key: self.types[:, :end]},
                    **self.encoder_outputs(position, end),
                ).logits
            )
            position = end
        assert position == self.ids.shape[1]
        return torch.cat(outputs, dim=1)

    def assert_close(self, got: torch.Tensor, expected: torch.Tensor, label: str) -> None:
        real = self.mask.bool()
        difference = (got[real] - expected[real]).abs().max().item()
        assert difference <= TOLERANCE, f"{label}: max |logit difference| = {difference:.3g}"

    def block_boundaries(self) -> set[int]:
        """Columns strictly inside an image block (a chunk may not start there when the oracle is no-cache)."""
        image = (self.ids == IMAGE_ID).any(0).tolist()
        return {i for i in range(1, len(image)) if image[i] and image[i - 1]}


def schedule_avoiding(scene: Scene, sizes: list[int]) -> list[int]:
    """Chunk sizes close to `sizes` whose boundaries never fall inside an image block."""
    total, inside, schedule, position = scene.ids.shape[1], scene.block_boundaries(), [], 0
    for size in sizes:
        end = min(total, position + size)
        while end in inside:
            end += 1
        schedule.append(end - position)
        position = end
        if position == total:
            return schedule
    return schedule + [total - position]


def test_bidirectional_mask_is_exercised(family):
    """Guard for the tests below: token types change the logits at image positions (the bidirectional block is
    really in the mask), so an implementation that dropped it would fail them."""
    scene = Scene(family, "sdpa", [[3, "image", 3]])
    with torch.no_grad():
        without = scene.model(
            input_ids=scene.ids, attention_mask=scene.mask, use_cache=False, **scene.encoder_outputs()
        ).logits
    image = scene.ids[0] == IMAGE_ID
    assert (scene.no_cache_logits()[0, image] - without[0, image]).abs().max() > 1e-3


def dynamic_or_refused(dynamic, ring):
    """`(ring(), dynamic())`, or `(None, None)` where DynamicCache itself fails on the installed release and the ring
    refuses the same call with `PreparedMaskError` (before writing anything). transformers 5.14's Gemma 3 / 4 build
    the sliding layers' masks from token types as wide as the whole conversation (`create_masks_for_vision_model`),
    which no sliding-window cache's keys match once it holds more than the window: DynamicCache fails inside
    attention with a tensor-shape error; 5.5 and 5.18+ build them per layer type."""
    try:
        with reference_masks():  # the oracle on transformers' dense masks (the banded path is what is tested)
            expected = dynamic()
    except RuntimeError as error:
        if "must match the size" not in str(error):
            raise
        with pytest.raises(PreparedMaskError, match="keys wide"):
            ring()
        return None, None
    return ring(), expected


# --- text only, as the processor sends it --------------------------------------------------------------------------
def test_text_only_with_token_types(family, attn):
    """All-zero token types: two `generate` turns on one cache, chunked prefill smaller than the prompt, and a manual
    decode loop passing each step's own token types (before and after the wrap): tokens equal DynamicCache's,
    logits equal the no-cache forward's."""
    scene = Scene(family, attn, [[14]])
    model, key = scene.model, scene.type_key
    kwargs = dict(max_new_tokens=9, min_new_tokens=9, do_sample=False, pad_token_id=0)

    def two_turns(make_cache, **extra):
        cache = make_cache()
        first = model.generate(
            input_ids=scene.ids,
            attention_mask=scene.mask,
            **cache_kwargs(cache),
            **{key: torch.zeros_like(scene.ids)},
            **kwargs,
            **extra,
        )
        follow = torch.tensor([sequence([5], 4, seed=9)])
        ids = torch.cat([first, follow], 1)
        return model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            **cache_kwargs(cache),
            **{key: torch.zeros_like(ids)},
            **kwargs,
            **extra,
        )

    with torch.no_grad():
        for extra in ({}, {"prefill_chunk_size": 3}):
            if extra and TRANSFORMERS_VERSION < CHUNKED_PREFILL_CONTINUES_SINCE:
                # Such a release feeds the second turn's whole conversation again: refused, saying why (DynamicCache
                # silently attends over the repeated tokens twice).
                with pytest.raises(ConversationMismatchError, match="prefill_chunk_size"):
                    two_turns(lambda: HybridRingCache(model.config), **extra)
                continue
            ring, dynamic = dynamic_or_refused(
                lambda extra=extra: two_turns(lambda: DynamicCache(config=model.config), **extra),
                lambda extra=extra: two_turns(lambda: HybridRingCache(model.config), **extra),
            )
            assert ring is None or torch.equal(ring, dynamic), extra

    # Manual loop: prompt, then one token at a time with that token's own token type (a common hand-written loop).
    def manual_loop(cache):
        ids = scene.ids
        logits = [
            model(input_ids=ids[:, :6], **cache_kwargs(cache), **{key: torch.zeros(1, 6, dtype=torch.long)}).logits
        ]
        for position in range(6, ids.shape[1]):
            one = {key: torch.zeros(1, 1, dtype=torch.long)}
            logits.append(model(input_ids=ids[:, position : position + 1], **cache_kwargs(cache), **one).logits)
        return torch.cat(logits, 1)

    with torch.no_grad():
        ring, _ = dynamic_or_refused(
            lambda: manual_loop(DynamicCache(config=model.config)), lambda: manual_loop(HybridRingCache(model.config))
        )
    if ring is not None:
        scene.assert_close(ring, scene.no_cache_logits(), "manual loop")


# --- images: logits against the no-cache forward ---------------------------------------------------------------------
SCENES = {
    # rows of parts; window; tokens per image
    "image-first-turn": ([["image", 10]], 4, 4),
    "image-after-wrap": ([[13, "image", 7]], 4, 4),
    "block-longer-than-window": ([[5, "image", 6]], 3, 9),
    "batch-images-in-different-rows": ([[2, "image", 9], [11, "image", 2, "image", 3]], 4, 4),
}


@pytest.mark.parametrize("name", SCENES)
def test_images_match_dynamic_cache(family, attn, name):
    """On every release (the oracle below needs `mm_encoder_outputs`): the same random chunk schedules through
    DynamicCache give the same logits at every real token."""
    rows, window, tokens = SCENES[name]
    scene = Scene(family, attn, rows, window=window, tokens_per_image=tokens)
    for seed in range(3):
        schedule = random_image_schedule(scene, name, seed, window)
        got, expected = dynamic_or_refused(
            lambda schedule=schedule: scene.chunked_logits(DynamicCache(config=scene.model.config), schedule),
            lambda schedule=schedule: scene.chunked_logits(HybridRingCache(scene.model.config), schedule),
        )
        if got is not None:
            scene.assert_close(got, expected, f"{name} schedule={schedule}")


def random_image_schedule(scene: Scene, name: str, seed: int, window: int) -> list[int]:
    """Random chunks (shorter and longer than the window), then one-token steps; never inside an image block."""
    rng = random.Random(f"{name}-{seed}")
    sizes = [rng.choice([1, 2, window, window + 1, 2 * window + 3]) for _ in range(3)] + [1] * scene.ids.shape[1]
    return schedule_avoiding(scene, sizes)


@needs_encoder_outputs
@pytest.mark.parametrize("name", SCENES)
def test_images_match_no_cache(family, attn, name):
    """Random chunks (shorter and longer than the window) then one-token steps, the rings wrapping before, inside
    or after the image blocks, with left padding in the batch scene: logits equal the no-cache forward at every real
    token. Each image block is fed within one step, as a no-cache forward sees it."""
    rows, window, tokens = SCENES[name]
    scene = Scene(family, attn, rows, window=window, tokens_per_image=tokens)
    expected = scene.no_cache_logits()
    for seed in range(3):
        schedule = random_image_schedule(scene, name, seed, window)
        got = scene.chunked_logits(HybridRingCache(scene.model.config), schedule)
        scene.assert_close(got, expected, f"{name} schedule={schedule}")


@needs_encoder_outputs
@pytest.mark.parametrize("schedule", [[8, 6, 5, 1, 1, 1, 1, 1], [4, 12, 1, 1, 1, 1, 1, 1, 1, 1], [15] + [1] * 9])
def test_smaller_cache_window_is_refused_with_images(family, attn, schedule):
    """A cache built for a smaller window (3) than the model's (6), e.g. from another config: the first step whose
    window reaches an overwritten key (a chunk holding the image block, or a one-token step after it) raises
    `WindowMismatchError` before writing; every step before it equals the no-cache forward. Never a wrong logit."""
    scene = Scene(family, attn, [[9, "image", 9]], window=6)
    expected = scene.no_cache_logits()
    config = copy.deepcopy(scene.model.config)
    config.get_text_config(decoder=True).sliding_window = 3
    cache, position = HybridRingCache(config), 0
    with torch.no_grad():
        for size in schedule:
            end = position + size
            step = dict(
                input_ids=scene.ids[:, position:end],
                attention_mask=scene.mask[:, :end],
                **cache_kwargs(cache),
                **{scene.type_key: scene.types[:, :end]},
                **scene.encoder_outputs(position, end),
            )
            try:
                logits = scene.model(**step).logits
            except WindowMismatchError:
                assert cache.get_seq_length() == position, "a refused step wrote into the cache"
                return
            difference = (logits - expected[:, position:end]).abs().max().item()  # one row, no padding
            assert difference <= TOLERANCE, f"step at {position}: |logit difference| {difference:.3g}"
            position = end
    pytest.fail(f"schedule {schedule} ran to the end with a 3-token ring under a 6-token model window")


@pytest.mark.parametrize("split", [1, 2, 3], ids=lambda s: f"split{s}")
def test_chunk_boundary_inside_image_matches_dynamic(family, attn, split):
    """A chunk boundary `split` tokens into an image block longer than the window: no cache can show the block's
    first tokens the later ones, so the oracle is DynamicCache with the same chunks (logits of every position)."""
    scene = Scene(family, attn, [[6, "image", 5]], window=3, tokens_per_image=9)
    start = int((scene.ids[0] == IMAGE_ID).nonzero()[0])
    schedule = [start + split, scene.ids.shape[1] - start - split - 4, 1, 1, 1, 1]
    ring, dynamic = dynamic_or_refused(
        lambda schedule=schedule: scene.chunked_logits(DynamicCache(config=scene.model.config), schedule),
        lambda schedule=schedule: scene.chunked_logits(HybridRingCache(scene.model.config), schedule),
    )
    if ring is not None:
        scene.assert_close(ring, dynamic, f"schedule={schedule}")


@needs_encoder_outputs
def test_generate_with_images_multi_turn(family, attn):
    """`generate` as a chat: turn 1 with an image (prefill chunked across the image block, as `prefill_chunk_size`
    does it), turn 2 adds text and a new image after the rings wrapped; same cache throughout. Tokens and every
    step's logits equal DynamicCache's; logits of the unchunked turns equal the no-cache run's."""
    tokens = 4
    model = BUILDERS[family](window=4, attn=attn, tokens_per_image=tokens)
    key = TYPE_KEY[family]
    kwargs = dict(
        max_new_tokens=8,
        min_new_tokens=8,
        do_sample=False,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_logits=True,
    )
    turn1 = torch.tensor([sequence([3, "image", 6], tokens, seed=1)])
    turn2_extra = torch.tensor([sequence([4, "image", 3], tokens, seed=2)])
    images = random_images(model, 2, seed=3)
    first_image = {k: v[:1] for k, v in images.items()}
    second_image = {k: v[1:] for k, v in images.items()}
    with torch.no_grad():
        encoded_first = {
            "mm_encoder_outputs": {"image": model.model.get_image_features(**first_image, return_dict=True)}
        }

    def chat(cache, chunked: bool):
        outputs = []
        extra = dict(prefill_chunk_size=5, **encoded_first) if chunked else first_image
        out = model.generate(
            input_ids=turn1,
            attention_mask=torch.ones_like(turn1),
            **cache_kwargs(cache),
            **{key: (turn1 == IMAGE_ID).long()},
            **extra,
            **kwargs,
        )
        outputs.append(out)
        ids = torch.cat([out.sequences, turn2_extra], 1)
        # With a cache, turn 2 processes only its new tokens: the new image's pixels; without, all of them.
        pixels = second_image if cache is not None else images
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            **cache_kwargs(cache),
            use_cache=cache is not None,
            **{key: (ids == IMAGE_ID).long()},
            **pixels,
            **kwargs,
        )
        outputs.append(out)
        return outputs

    with torch.no_grad():
        for chunked in (False, True):
            ring = chat(HybridRingCache(model.config), chunked)
            with reference_masks():
                dynamic = chat(DynamicCache(config=model.config), chunked)
            for turn, (r, d) in enumerate(zip(ring, dynamic)):
                assert torch.equal(r.sequences, d.sequences), f"turn {turn} chunked={chunked}: tokens differ"
                difference = (torch.stack(r.logits) - torch.stack(d.logits)).abs().max().item()
                assert difference <= TOLERANCE, f"turn {turn} chunked={chunked}: logits {difference:.3g}"
        with reference_masks():
            no_cache = chat(None, chunked=False)
            dynamic = chat(DynamicCache(config=model.config), chunked=False)
        ring = chat(HybridRingCache(model.config), chunked=False)
        for turn, (r, n, d) in enumerate(zip(ring, no_cache, dynamic)):
            if (torch.stack(d.logits) - torch.stack(n.logits)).abs().max().item() > TOLERANCE:
                continue  # transformers' own cache is off the no-cache run here (5.18's second image turn): the
                # ring was held to DynamicCache above
            assert torch.equal(r.sequences, n.sequences), f"turn {turn}: tokens differ from no cache"
            difference = (torch.stack(r.logits) - torch.stack(n.logits)).abs().max().item()
            assert difference <= TOLERANCE, f"turn {turn}: logits differ from no cache by {difference:.3g}"
