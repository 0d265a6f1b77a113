"""Offline batch generation: LLM(model).generate(prompts, params)."""
import itertools
from dataclasses import dataclass

from service.config import Settings
from service.engine.llm_engine import LLMEngine
from service.engine.sampling_params import SamplingParams


@dataclass
class RequestOutput:
    prompt: str | list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    cached_prompt_tokens: int = 0


class LLM:
    def __init__(self, model: str | None = None, **settings_overrides):
        self.engine = LLMEngine(Settings(model=model, **settings_overrides))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """prompts: strings or token-id lists (or one of either). Runs them all to completion, batched."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        results = {}
        for prompt, p in zip(prompts, params, strict=True):
            rid = f"llm-{next(self._ids)}"
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            self.engine.add_request(rid, ids, p)
            results[rid] = RequestOutput(prompt, "", [], None)
        while self.engine.has_work:
            outputs, _ = self.engine.step()
            for out in outputs:
                r = results[out.request_id]
                r.text += out.text
                r.token_ids.append(out.token_id)
                r.cached_prompt_tokens = out.cached_prompt_tokens
                if out.finished:
                    r.finish_reason = out.finish_reason
        return list(results.values())
