#!/usr/bin/env bash
# GPU check of the trainer runtime, in two parts. A few minutes on one GPU.
#
# 1. Always (needs torch + transformers only): python -m rlpacer_trainer.gpu_check: the
#    learner's update on CUDA in bfloat16 against the CPU float32 path (loss, gradients),
#    the learner checkpoint round trip on the device, the FSDP-sharded learner on every GPU
#    of the machine (bf16 loss against float32, per-GPU peak memory against the fit
#    estimate), and weight publication throughput (bytes per update, extrapolated to 7B).
# 2. When CUDA vLLM is importable: engine start, greedy accuracy of the shipped warm start,
#    finish order + abort, in-place weight sync, and a few RL steps through the real driver.
#    Skipped, and said so, where vLLM is not installed (a bare GPU machine).
#
# Needs a Python with torch and this project importable, e.g.
#   pip install --no-deps -e . && bash scripts/gpu_check.sh
# Prints one JSON line per check and "GPU CHECK OK" at the end of each part.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
export PYTHONPATH="$ROOT/operator:$ROOT/trainer_image${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false
"$PY" -m rlpacer_trainer.gpu_check "$@"
if ! "$PY" -c 'import vllm, ray' 2>/dev/null; then
  echo '{"check": "vllm_engine", "skipped": "vllm or ray is not installed here"}'
  exit 0
fi
"$PY" - <<'PY'
import json, time
import torch
from rlpacer_trainer import task, tiny, runtime
from rlpacer_trainer.config import RunConfig
from rlpacer_trainer.engine import GenRequest, VLLMEngine, EngineConfig
from rlpacer_trainer.learner import state_bytes

assert torch.cuda.is_available(), "no CUDA device visible"
path = tiny.resolve_source("builtin://tiny-chain")
t0 = time.time()
# on CUDA the CPU-only knobs (KV space, thread binding) are ignored by vLLM
eng = VLLMEngine(EngineConfig(model_path=str(path), single_process=False))
print(json.dumps({"check": "engine_start", "seconds": round(time.time() - t0, 1),
                  "device": torch.cuda.get_device_name(0)}), flush=True)

evalset = task.make_problems(256, seed=task.EVAL_SEED)
def greedy(tag):
    reqs = [GenRequest(f"{tag}-{i}", tuple(tiny.prompt_ids(p.prompt)), 192, 0.0)
            for i, p in enumerate(evalset)]
    done = eng.generate(reqs)
    outs = [done[r.request_id] for r in reqs]
    acc = sum(o.finish_reason == "stop" and task.reward(tiny.decode(list(o.token_ids)), p) == 1.0
              for o, p in zip(outs, evalset)) / len(evalset)
    return acc, [o.token_ids for o in outs]
acc, base = greedy("a")
print(json.dumps({"check": "warm_start_greedy_accuracy", "value": acc}), flush=True)

reqs = [GenRequest(f"ab-{i}-{j}", tuple(tiny.prompt_ids(p.prompt)), 192, 1.0, 7 * i + j)
        for i, p in enumerate(evalset[:32]) for j in range(4)]
eng.submit(reqs)
fin = []
while len(fin) < 40:
    fin += eng.poll()
eng.abort([r.request_id for r in reqs])
assert eng.pending() == 0
print(json.dumps({"check": "finish_order_abort", "finished": len(fin),
                  "aborted": eng.stats().aborted}), flush=True)

sec = eng.load_weights(state_bytes(tiny.new_model(seed=3)))
_, changed = greedy("b")
assert changed != base, "weight sync did not change outputs"
eng.load_weights(state_bytes(tiny.load_model(path)))
_, back = greedy("c")
print(json.dumps({"check": "weight_sync", "seconds": round(sec, 3), "restored": back == base}),
      flush=True)

cfg = RunConfig.load("examples/tiny-local.yaml", steps=6, eval_prompts=256)
drv = runtime.build_driver(cfg, [eng])
t0 = time.time()
drv.run()
after = drv.evaluate(evalset)
print(json.dumps({"check": "rl_steps", "steps": len(drv.records),
                  "seconds": round(time.time() - t0, 1), "accuracy_before": acc,
                  "accuracy_after": after,
                  "group_sizes": [r["group_size"] for r in drv.records],
                  "kinds": [r["round_kind"] for r in drv.records]}), flush=True)
print("GPU CHECK OK")
PY
