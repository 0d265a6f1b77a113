"""Offline batch generation: LLM(model).generate(prompts, params). The engine runs in this process (no IPC), with
the same text handling as the HTTP front-ends: for benchmarks, scripts and notebooks."""
import itertools
from dataclasses import dataclass

from service.config import Settings
from service.engine.llm_engine import EngineStepError, LLMEngine
from service.protocol import SamplingParams, choice_ids
from service.text import TextStream, load_tokenizer


@dataclass
class RequestOutput:
    prompt: str | list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    cached_prompt_tokens: int = 0
    index: int = 0  # which of the prompt's params.n completions


class LLM:
    def __init__(self, model: str | None = None, **settings_overrides):
        self.engine = LLMEngine(Settings(model=model, **settings_overrides))
        self.tokenizer = load_tokenizer(self.engine.model_dir)  # text is handled here, as in a front-end
        self._ids = itertools.count()

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """prompts: strings or token-id lists (or one of either). Runs them all to completion, batched: one output
        per prompt, or params.n of them in a row. Raises EngineStepError if a step fails."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        results, texts = {}, {}
        for prompt, p in zip(prompts, params, strict=True):
            rid = f"llm-{next(self._ids)}"
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            self.engine.add_request(rid, ids, p)
            for index, choice in enumerate(choice_ids(rid, p.n)):
                results[choice] = RequestOutput(prompt, "", [], None, index=index)
                texts[choice] = TextStream(self.tokenizer, ids, p.stop, p.include_stop_str_in_output)
        while self.engine.has_work:
            outputs, _ = self.engine.step()
            for out in outputs:
                if out.error is not None:
                    raise EngineStepError(out.error)
                r = results[out.request_id]
                if r.finish_reason is not None:  # ended by a stop string; the engine had one more in flight
                    continue
                piece, hit_stop = texts[out.request_id].add(out.token_id)
                r.text += piece
                r.token_ids.append(out.token_id)
                if out.prompt_tokens:
                    r.cached_prompt_tokens = out.cached_prompt_tokens
                if hit_stop:
                    r.finish_reason = "stop"
                    self.engine.abort(out.request_id)
                elif out.finish_reason is not None:
                    r.text += texts[out.request_id].flush()
                    r.finish_reason = out.finish_reason
        return list(results.values())
