"""HF transformers greedy generate for bench/decode.py (runs in a Python with torch; prints one JSON line).

    python bench/hf_generate.py HF_DIR REQUEST_JSON
"""

import json
import sys
import time

import torch
import transformers
from transformers import DeepseekV3ForCausalLM

torch.set_num_threads(max(1, torch.get_num_threads()))
model = DeepseekV3ForCausalLM.from_pretrained(sys.argv[1], torch_dtype=torch.float32).eval()
req = json.load(open(sys.argv[2]))
tokens, seconds = [], 0.0
with torch.no_grad():
    for prompt in req["prompts"]:
        ids = torch.tensor([prompt])
        kw = dict(do_sample=False, max_new_tokens=req["new_tokens"], eos_token_id=None, pad_token_id=0)
        model.generate(ids, **{**kw, "max_new_tokens": 2})                            # warm up
        t0 = time.perf_counter()
        out = model.generate(ids, **kw)
        seconds += time.perf_counter() - t0
        tokens.append(out[0, len(prompt):].tolist())
print(json.dumps({"tokens": tokens, "seconds": seconds, "transformers": transformers.__version__,
                  "torch": torch.__version__}))
