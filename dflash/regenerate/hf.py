"""The built-in backend: batched `model.generate` of a Hugging Face causal LM in this process."""

from __future__ import annotations

import collections
import contextlib
import inspect
import logging
import math
from dataclasses import replace
from typing import Any, Literal

import torch

from dflash.errors import BadInput, DflashError
from dflash.models.families import text_config_of
from dflash.regenerate.attention import grouped_query_decoding
from dflash.regenerate.core import Progress, Reply, SamplingParams, derive_seed

log = logging.getLogger(__name__)

END_OF_TURN_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")
CACHE_LEN_MULTIPLE = 256  # static caches are sized per batch, rounded up: few distinct shapes
BATCHING_MODES = ("static", "refill", "continuous")
REFILL_FRACTION = 0.5  # batching="refill": a batch is refilled once this share of its rows has finished
COMPILED_WIDTH_MULTIPLE = 64  # compiled decoding: prompt widths padded to a multiple (few distinct shapes)


def stop_token_ids(tokenizer, model=None) -> list[int]:
    """The tokenizer's EOS, the chat template's end-of-turn marker(s) where they are separate tokens, and the
    model's own generation-config EOS ids; only ids the tokenizer has (random targets have larger tables)."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    for marker in END_OF_TURN_MARKERS:
        if marker in vocab:
            ids.add(int(vocab[marker]))
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if gen_eos is not None:
        ids.update(int(t) for t in ([gen_eos] if isinstance(gen_eos, int) else gen_eos))
    ids = {t for t in ids if 0 <= t < len(tokenizer)}
    if not ids:
        raise BadInput(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no EOS / end-of-turn token: "
                       "the target could not stop its answers")
    return sorted(ids)


def render_prompt(tokenizer, prefix: list[dict[str, str]], params: SamplingParams) -> list[int]:
    """Prompt ids exactly as the trainer tokenizes rendered text (chat template, then no special tokens added)."""
    text = tokenizer.apply_chat_template(prefix, tokenize=False, add_generation_prompt=True, **params.template_kwargs())
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@contextlib.contextmanager
def _clean_generation_config(model):
    """transformers fills unset generation options from the model's generation_config.json (e.g. top_k 20,
    repetition_penalty): answers here use only what SamplingParams says."""
    from transformers import GenerationConfig

    saved = getattr(model, "generation_config", None)
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved


def _cpu_continuous_batching_config(prompts: list[list[int]], max_new_tokens: int):
    """A paged cache that holds exactly these requests (None where this transformers has no such config)."""
    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    except ImportError:
        return None
    page = getattr(ContinuousBatchingConfig, "page_size", None) or getattr(ContinuousBatchingConfig, "block_size", 16)
    blocks = sum(math.ceil((len(p) + max_new_tokens) / page) for p in prompts) + 1
    try:
        return ContinuousBatchingConfig(num_blocks=blocks, max_batch_tokens=max(2048, max(len(p) for p in prompts)))
    except TypeError:
        return None


@contextlib.contextmanager
def _quiet_logger(name: str):
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _enough_rows_done(start: int, stop_ids: list[int], rows: int):
    """A transformers stopping criterion: every row stops once REFILL_FRACTION of the rows have generated a
    stop token after column `start` (tensor ops only: no host sync of its own)."""
    from transformers import StoppingCriteria

    need = max(1, math.ceil(REFILL_FRACTION * rows))
    stops = torch.tensor(stop_ids, dtype=torch.long)

    class EnoughRowsDone(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
            done = torch.isin(input_ids[:, start:], stops.to(input_ids.device)).any(-1)
            return (done.sum() >= need).expand_as(done)

    return EnoughRowsDone()


class TransformersBackend:
    """Answers with `model.generate`: prompts sorted by length (longest first) into batches of similar
    lengths, left padding, a static KV cache sized per batch (the default cache where the model has none),
    greedy unless temperature > 0, token ids the tokenizer lacks forbidden.

    compile (default: on CUDA): the decode step is compiled by transformers (torch.compile, CUDA graphs)
    over the static cache; prompt widths are then padded to a multiple of 64 so that a run sees few shapes.
    Grouped-query `sdpa` targets decode without copying K/V per query head (`dflash.regenerate.attention`).

    batching="refill": static batches that stop once half their rows have finished; the finished rows are
    answered and replaced by the next prompts, the unfinished ones go on from their prompt plus what they
    generated (one prefill of it), so long answers do not hold a batch of finished rows. Greedy answers equal
    the static mode's.

    batching="continuous": transformers' continuous batching (`model.generate_batch`, paged attention,
    finished rows refilled); greedy answers equal the static mode's; sampling is not reproducible there.
    """

    name = "transformers"

    def __init__(self, model, tokenizer, batch_size: int = 64,
                 batching: Literal["static", "refill", "continuous"] = "static", pad_to_multiple_of: int | None = None,
                 compile: bool | None = None, check_roundtrip: bool = True):
        if batch_size < 1:
            raise BadInput(f"batch_size must be >= 1, got {batch_size}")
        if batching not in BATCHING_MODES:
            raise BadInput(f"batching must be one of {', '.join(BATCHING_MODES)}, got {batching!r}")
        if not getattr(tokenizer, "chat_template", None):
            raise BadInput(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template")
        self.model, self.tokenizer = model, tokenizer
        self.batch_size, self.batching = batch_size, batching
        self.device = next(model.parameters()).device
        self.compile = (self.device.type == "cuda") if compile is None else bool(compile)
        self.pad_to_multiple_of = pad_to_multiple_of or (COMPILED_WIDTH_MULTIPLE if self.compile else None)
        self.check_roundtrip = check_roundtrip
        text_config = text_config_of(model.config)
        out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        logits_dim = int(out_emb.weight.shape[0]) if out_emb is not None else int(text_config.vocab_size)
        self.vocab_limit = len(tokenizer)
        # Random-weight targets have embedding tables larger than the tokenizer: those ids have no text.
        self.suppress = list(range(self.vocab_limit, logits_dim)) or None
        self.stop_ids = stop_token_ids(tokenizer, model)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.stop_ids[0]
        self.max_positions = getattr(text_config, "max_position_embeddings", None)
        self._static: bool | None = None  # static KV cache works with this model (None: not tried yet)
        self.gqa_decode = True  # decode steps of grouped-query sdpa attention without copying K/V per head
        self._warned_roundtrip = False

    # ----------------------------------------------------------------------------------------- info
    def describe(self) -> dict[str, Any]:
        cfg = text_config_of(self.model.config)
        return {"backend": self.name, "model_type": getattr(cfg, "model_type", None),
                "model_class": type(self.model).__name__, "dtype": str(next(self.model.parameters()).dtype),
                "device": str(self.device), "batching": self.batching, "batch_size": self.batch_size,
                "compiled_decoding": self.compile,
                "kv_cache": {None: "static (untried)", True: "static", False: "default"}[self._static]
                if self.batching != "continuous" else "paged",
                "stop_token_ids": self.stop_ids, "suppressed_token_ids": len(self.suppress or [])}

    def prompt_limit(self, params: SamplingParams) -> int | None:
        if params.max_prompt_tokens is not None:
            return params.max_prompt_tokens
        if self.max_positions is None:
            return None
        limit = int(self.max_positions) - params.max_new_tokens
        if limit < 1:
            raise BadInput(f"max_new_tokens {params.max_new_tokens} leaves no room for a prompt in the target's "
                           f"{self.max_positions} positions; lower max_new_tokens")
        return limit

    # ------------------------------------------------------------------------------------- generate
    @torch.no_grad()
    def generate(self, prefixes: list[list[dict[str, str]]], params: SamplingParams,
                 progress: Progress | None = None) -> list[Reply]:
        params.validate()
        prompts = [render_prompt(self.tokenizer, p, params) for p in prefixes]
        limit = self.prompt_limit(params)
        replies: list[Reply | None] = [None] * len(prompts)
        todo = []
        for i, ids in enumerate(prompts):
            if limit is not None and len(ids) > limit:
                replies[i] = Reply(None, prompt_tokens=len(ids))
            else:
                todo.append(i)
        if progress is not None and len(todo) < len(prompts):
            progress(len(prompts) - len(todo), 0)
        todo.sort(key=lambda i: (-len(prompts[i]), i))  # longest first: memory peaks at once, not at the end
        if self.batching == "refill":
            self._generate_refill(todo, prefixes, prompts, params, replies, progress)
            return replies  # type: ignore[return-value]
        if self.batching == "continuous":
            batches = [todo] if todo else []
        else:
            batches = [todo[s:s + self.batch_size] for s in range(0, len(todo), self.batch_size)]
        for b, batch in enumerate(batches):
            seed = derive_seed(params.seed, "batch", b)
            if self.batching == "continuous":
                outs = self._generate_continuous([prompts[i] for i in batch], params, seed)
            else:
                outs = self._generate_static([prompts[i] for i in batch], params, seed)
            tokens = 0
            for i, gen in zip(batch, outs, strict=True):
                replies[i] = self._reply(prefixes[i], prompts[i], gen, params)
                tokens += replies[i].new_tokens
            if progress is not None:
                progress(len(batch), tokens)
        return replies  # type: ignore[return-value]

    def _generate_refill(self, todo: list[int], prefixes, prompts: list[list[int]], params: SamplingParams,
                         replies: list[Reply | None], progress: Progress | None) -> None:
        queue = collections.deque(todo)
        active: list[tuple[int, list[int]]] = []  # (prompt index, tokens generated so far)
        rounds = 0
        while queue or active:
            while len(active) < self.batch_size and queue:
                active.append((queue.popleft(), []))
            budget = max(params.max_new_tokens - len(gen) for _, gen in active)
            outs = self._generate_static([prompts[i] + gen for i, gen in active],
                                         replace(params, max_new_tokens=budget),
                                         derive_seed(params.seed, "batch", rounds), refill=len(queue) > 0)
            rounds += 1
            still, answered, tokens = [], 0, 0
            for (i, gen), out in zip(active, outs, strict=True):
                out = out[: params.max_new_tokens - len(gen)]
                cut = self._stop_index(out)
                gen = gen + (out if cut is None else out[: cut + 1])
                if cut is None and len(gen) < params.max_new_tokens:
                    still.append((i, gen))  # stopped with the batch: goes on in the next round
                    continue
                replies[i] = self._reply(prefixes[i], prompts[i], gen, params)
                answered += 1
                tokens += replies[i].new_tokens
            active = still
            if progress is not None and answered:
                progress(answered, tokens)

    def _generation_config(self, params: SamplingParams, **extra):
        from transformers import GenerationConfig

        kwargs: dict[str, Any] = {"max_new_tokens": params.max_new_tokens, "eos_token_id": list(self.stop_ids),
                                  "pad_token_id": self.pad_id, "suppress_tokens": self.suppress}
        if params.greedy:
            kwargs["do_sample"] = False
        else:  # pure temperature + nucleus sampling (no top-k, no penalties), as OpenAI-style servers do
            kwargs.update(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=0)
        if not self.compile:
            kwargs["disable_compile"] = True
        kwargs.update(extra)
        return GenerationConfig(**kwargs)

    @contextlib.contextmanager
    def _seeded(self, params: SamplingParams, seed: int):
        if params.greedy:
            yield
            return
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):  # the caller's RNG streams stay untouched
            torch.manual_seed(seed)
            yield

    def _generate_static(self, prompts: list[list[int]], params: SamplingParams, seed: int,
                         refill: bool = False) -> list[list[int]]:
        """Generated ids per row (after a stop token: padding). refill: the whole batch stops as soon as
        REFILL_FRACTION of its rows have produced a stop token (the others are then cut where they are)."""
        width = max(len(p) for p in prompts)
        if self.pad_to_multiple_of:
            width = math.ceil(width / self.pad_to_multiple_of) * self.pad_to_multiple_of
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for r, p in enumerate(prompts):  # left padding: every row's answer starts at column `width`
            ids[r, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[r, width - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        cache_len = math.ceil((width + params.max_new_tokens) / CACHE_LEN_MULTIPLE) * CACHE_LEN_MULTIPLE

        def run(static: bool):
            extra = {"cache_implementation": "static", "max_cache_len": cache_len} if static else {}
            if static:  # size this batch's cache for this batch (transformers otherwise keeps the largest:
                self.model._previous_max_cache_length = -1  # attention over unused slots)
            gqa = grouped_query_decoding(self.model) if self.gqa_decode else contextlib.nullcontext()
            with _clean_generation_config(self.model), self._seeded(params, seed), gqa:
                criteria = None
                if refill and self.stop_ids:
                    from transformers import StoppingCriteriaList

                    criteria = StoppingCriteriaList([_enough_rows_done(width, self.stop_ids, len(prompts))])
                return self.model.generate(input_ids=ids, attention_mask=mask, stopping_criteria=criteria,
                                           generation_config=self._generation_config(params, **extra))

        if self._static is False:
            out = run(False)
        else:
            try:
                out = run(True)
            except (ValueError, TypeError, NotImplementedError, AttributeError, KeyError, RuntimeError) as exc:
                if self._static or isinstance(exc, torch.OutOfMemoryError):
                    raise
                log.warning("static KV cache not supported by %s (%s: %s); generating with the default cache",
                            type(self.model).__name__, type(exc).__name__, str(exc).splitlines()[0][:200])
                self._static = False
                out = run(False)
            else:
                if self._static is None:
                    log.info("generating with a static KV cache")
                self._static = True
        return out[:, width:].tolist()

    def _generate_continuous(self, prompts: list[list[int]], params: SamplingParams, seed: int) -> list[list[int]]:
        gc = self._generation_config(params)
        kwargs: dict[str, Any] = {"progress_bar": False}
        quiet = contextlib.nullcontext()
        if self.device.type != "cuda":
            # Off the GPU transformers sizes the paged cache from system memory (seconds, and an error line
            # without psutil): size it for these requests instead, where this transformers version allows.
            kwargs["warmup"] = False
            cb_config = _cpu_continuous_batching_config(prompts, params.max_new_tokens)
            if cb_config is not None:
                kwargs["continuous_batching_config"] = cb_config
            quiet = _quiet_logger("ContinuousBatchingLogger")
        accepted = inspect.signature(self.model.generate_batch).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
            kwargs = {k: v for k, v in kwargs.items() if k in accepted}
        with _clean_generation_config(self.model), self._seeded(params, seed), quiet:
            results = self.model.generate_batch(inputs=prompts, generation_config=gc, **kwargs)
        outs = list(results.values())
        failed = [o.request_id for o in outs if getattr(o, "error", None) is not None]
        if len(outs) != len(prompts) or failed:
            raise DflashError(f"continuous batching lost or failed {len(prompts) - len(outs) + len(failed)} of "
                              f"{len(prompts)} requests (transformers' log above names them); rerun with "
                              "--batching static")
        return [list(o.generated_tokens) for o in outs]

    # --------------------------------------------------------------------------------------- decode
    def _stop_index(self, tokens: list[int]) -> int | None:
        """Position of the first stop token, or None."""
        stops = set(self.stop_ids)
        return next((k for k, t in enumerate(tokens) if t in stops), None)

    def _reply(self, prefix: list[dict[str, str]], prompt: list[int], gen: list[int],
               params: SamplingParams) -> Reply:
        cut = self._stop_index(gen)
        content = gen if cut is None else gen[:cut]
        content = content[:params.max_new_tokens]
        new_tokens = len(content) if cut is None else cut + 1
        # Special tokens stay (a faithful copy of what the target generated); the stop token is the template's.
        text = self.tokenizer.decode(content, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        ok = None
        if self.check_roundtrip and params.thinking != "strip":
            ok = self._roundtrip(prefix, prompt, content, text, params)
        return Reply(text, prompt_tokens=len(prompt), new_tokens=new_tokens, hit_max_new_tokens=cut is None,
                     roundtrip_ok=ok)

    def _roundtrip(self, prefix, prompt: list[int], content: list[int], text: str, params: SamplingParams) -> bool:
        """Whether the conversation with this answer, rendered and tokenized as the trainer does, holds the
        prompt's and the generated ids unchanged."""
        rendered = self.tokenizer.apply_chat_template([*prefix, {"role": "assistant", "content": text}],
                                                      tokenize=False, **params.template_kwargs())
        ids = self.tokenizer(rendered, add_special_tokens=False)["input_ids"]
        want = list(prompt) + list(content)
        ok = ids[:len(want)] == want
        if not ok and not self._warned_roundtrip:
            self._warned_roundtrip = True
            first = next((k for k, (a, b) in enumerate(zip(ids, want, strict=False)) if a != b),
                         min(len(ids), len(want)))
            log.warning("an answer does not survive re-rendering + re-tokenizing (first difference at token %d "
                        "of %d: the chat template or the tokenizer does not round-trip); counted as "
                        "roundtrip_mismatches", first, len(want))
        return ok
