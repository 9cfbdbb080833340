"""The transformers baseline for bench/compare.py: a minimal OpenAI completions server with
*static batching* around a Hugging Face model, the way a plain transformers deployment serves.

A batch starts when the previous one has finished: it takes every request waiting (up to
``--max-batch``), left-pads the prompts, prefills them in one forward and then decodes one token
per step for all rows (greedy, the model's own KV cache) until every row has its tokens. Requests
that arrive meanwhile wait for the next batch. Each token is streamed as it is made, so the same
client measures TTFT/TPOT as for the other engines. Only what the benchmark sends is supported:
``/v1/completions`` with a text prompt, ``max_tokens``, ``stream`` and ``ignore_eos``.

    python bench/peers/transformers_server.py --model FILE.gguf --port 8001 --max-batch 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import threading
import time
from dataclasses import dataclass, field

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from transformers import AutoModelForCausalLM, AutoTokenizer


@dataclass
class Pending:
    prompt_ids: list[int]
    max_tokens: int
    ignore_eos: bool
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue = field(default_factory=asyncio.Queue)  # token ids, then None


class StaticBatcher:
    def __init__(self, model, eos_id: int, pad_id: int, max_batch: int):
        self.model, self.eos_id, self.pad_id, self.max_batch = model, eos_id, pad_id, max_batch
        self.waiting: queue.Queue[Pending] = queue.Queue()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            batch = [self.waiting.get()]
            while len(batch) < self.max_batch and not self.waiting.empty():
                batch.append(self.waiting.get_nowait())
            self._generate(batch)

    @torch.inference_mode()
    def _generate(self, batch: list[Pending]) -> None:
        width = max(len(p.prompt_ids) for p in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, p in enumerate(batch):  # left padding, so every row's next token is the last column
            ids[i, width - len(p.prompt_ids):] = torch.tensor(p.prompt_ids)
            mask[i, width - len(p.prompt_ids):] = 1
        done = [False] * len(batch)
        made = [0] * len(batch)
        past, step_input = None, ids
        position = (mask.cumsum(-1) - 1).clamp(min=0)
        while not all(done):
            out = self.model(input_ids=step_input, attention_mask=mask, position_ids=position,
                             past_key_values=past, use_cache=True, logits_to_keep=1)
            past = out.past_key_values
            next_ids = out.logits[:, -1].argmax(-1)
            for i, p in enumerate(batch):
                if done[i]:
                    continue
                tok = int(next_ids[i])
                made[i] += 1
                p.loop.call_soon_threadsafe(p.out.put_nowait, tok)
                if made[i] >= p.max_tokens or (tok == self.eos_id and not p.ignore_eos):
                    done[i] = True
                    p.loop.call_soon_threadsafe(p.out.put_nowait, None)
            step_input = next_ids[:, None]
            mask = torch.cat([mask, torch.ones((len(batch), 1), dtype=mask.dtype)], dim=1)
            position = position[:, -1:] + 1


def build_app(model_path: str, dtype: torch.dtype, max_batch: int, threads: int) -> FastAPI:
    torch.set_num_threads(threads)
    directory, name = os.path.split(os.path.abspath(model_path))
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, torch_dtype=dtype).eval()
    eos = tokenizer.eos_token_id
    batcher = StaticBatcher(model, eos, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos,
                            max_batch)
    model_id = name
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "owned_by": "transformers"}]}

    @app.get("/health")
    async def health():
        return {}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        prompt_ids = tokenizer(body["prompt"])["input_ids"]
        p = Pending(prompt_ids, int(body.get("max_tokens", 16)), bool(body.get("ignore_eos", False)),
                    asyncio.get_running_loop())
        batcher.waiting.put(p)
        created = int(time.time())

        async def stream():
            ids: list[int] = []
            sent = ""
            while (tok := await p.out.get()) is not None:
                ids.append(tok)
                text = tokenizer.decode(ids, skip_special_tokens=True)
                delta, sent = text[len(sent):], text
                chunk = {"id": "cmpl", "object": "text_completion", "created": created, "model": model_id,
                         "choices": [{"index": 0, "text": delta, "finish_reason": None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids),
                     "total_tokens": len(prompt_ids) + len(ids)}
            yield f"data: {json.dumps({'choices': [], 'usage': usage, 'model': model_id})}\n\n"
            yield "data: [DONE]\n\n"

        if body.get("stream"):
            return StreamingResponse(stream(), media_type="text/event-stream")
        text = ""
        async for line in stream():
            chunk = json.loads(line[6:]) if line.startswith("data: {") else {}
            text += "".join(c["text"] for c in chunk.get("choices", []))
        return JSONResponse({"object": "text_completion", "model": model_id,
                             "choices": [{"index": 0, "text": text, "finish_reason": "length"}]})

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="GGUF file (transformers dequantizes it)")
    ap.add_argument("--port", type=int, default=8001)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    a = ap.parse_args()
    app = build_app(a.model, getattr(torch, a.dtype), a.max_batch, a.threads)
    uvicorn.run(app, host="127.0.0.1", port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
