#!/bin/bash
# The next 15-minute loan, prepared (2026-12-04, after the second loan that day measured issue 52's compiled rows
# within 3% and the QLoRA step exactly): what is left, in the guide's order (issue 51, then 49, then 53):
#   1. issue 51: where an offloaded step's time goes. The host-stepped Llama row (4 layers at 7B width) ran at
#      1.39x its bound (369 ms, the host update's 265 ms); OffloadOptimizerStates.stages now times the worker's
#      updates, its waits for gradients, backward's waits to free them and the tail after backward (the bench's
#      third table). Then the CPU EMA row, cut by that loan's timeout.
#   2. issue 49: QLoRA as users load it (bench.qlora_load_gpu), now at Llama-2-7B sizes (issue 49's 7B class; the
#      3B row of that day: step -0.00%, from_pretrained's own peak +0.02% after the fix), and the peak through
#      peft's preparation too (prepared_*), where memfit predicts the fp32 upcast of what was not quantized.
#   3. issue 53: `--batch-size max` on the card (GPT-2, 12 GiB left: batch 6 trains, 7 runs out of memory) and
#      the first two FLUX.1-dev fp8 LoRA cases of tools/gpu/users_cases.json, if time is left.
# Before the call, here: bitsandbytes, diffusers, peft, importlib_metadata wheels in .whl (finetune_session.sh's list).
#   run(command="bash tools/gpu/next_loan.sh $(git rev-parse --short HEAD) 2>&1 | tee $OUT/log.txt",
#       carry=[".whl"], timeout_s=600)
# Then: offload rows to bench/results/, qlora_load.jsonl to tests/data/h200_qlora_load.jsonl (or an h100 file),
# gt.jsonl to tests/data/h200.jsonl with "host" (the probe in $OUT/host.json says which machine).
END_SECONDS=${END_SECONDS:-570}; source tools/gpu/session_env.sh "$1"
for r in llama4-offopt gpt2-ema-cpu; do
  [ "$(left)" -lt 200 ] && break
  el "offload $r"; timeout 170 python3 -m bench.offload_gpu --only $r --repeats 6 --out $OUT/offload_$r.jsonl 2>&1 | grep -v Warning | tail -20
done
if [ "$(left)" -gt 160 ]; then
  el "qlora load 7b"; timeout 150 python3 -m bench.qlora_load_gpu --size 7b --out $OUT/qlora_load.jsonl
  python3 -m bench.qlora_load_gpu --blind $OUT/qlora_load.jsonl tools/gpu/qlora7b_predicted.json \
    --preset $([ "$CARD" = h100 ] && echo h100-80gb || echo h200-141gb)
fi
CASES=tools/gpu/users_cases.json
if [ "$(left)" -gt 70 ]; then
  el "batch max"; python3 -m tools.gpu.ground_truth --cases $CASES --only "^m-" --out $OUT/gt.jsonl --timeout 60
fi
if [ "$(left)" -gt 120 ]; then
  el "flux"; python3 -m tools.gpu.ground_truth --cases $CASES --only "^f-flux-lora-fp8-(swap28-)?ondevice" \
    --out $OUT/gt.jsonl --timeout $(( $(left) - 15 ))
fi
python3 -m tools.gpu.compare_blind $OUT/gt.jsonl $(predicted users) --card $CARD
el done
