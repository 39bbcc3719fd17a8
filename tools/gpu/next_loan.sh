#!/bin/bash
# The next 15-minute loan, prepared (2026-12-04, after the second loan that day measured issue 52's compiled rows
# within 3% and the QLoRA step exactly): what is left, in the guide's order (issues 51, 52, 49, then 53):
#   1. issue 51: where an offloaded step's time goes. The host-stepped Llama row (4 layers at 7B width) ran at
#      1.39x its bound (369 ms, the host update's 265 ms); OffloadOptimizerStates.stages now times the worker's
#      updates, its waits for gradients, backward's waits to free them and the tail after backward (the bench's
#      third table).
#   1b. issue 52: compiled rows that ran alone (tools/gpu/alone_cases.json: GPT-2 compile full and blocks, Lumina2
#      LoRA with checkpointed blocks eager and compiled), for the time model's compiled pricing: the seed case came
#      out +61% by the fitted factors and +11% priced from its own kernels (tools.fit.compiled_ops), and every
#      other compiled row had run beside two jobs. Step times predicted blind: tools/gpu/alone_predicted.jsonl.
#      Last, a 3B QLoRA with compiled blocks (issues 52 and 49): a compiled forward's 4-bit matmuls now reach the
#      tracker as the eager step's do (NOTE [ The modes again, in order ]): 16.59 GiB allocated and 19.32 GiB
#      reserved predicted (19.77 GiB reserved before that fix; torch 2.11's prediction the same).
#   1c. issue 51: a paged optimizer's page migration alone (tools/gpu/migration_probe.py: 8-bit states of 2.1e9
#      elements at three rooms, against the states on the card): memfit adds both directions; the H200's recipe row
#      and torchtune's published 4090 rate (bench/published_rows.py) say it migrates faster than that.
#   2. issue 49: QLoRA as users load it (bench.qlora_load_gpu), now at Llama-2-7B sizes (issue 49's 7B class; the
#      3B row of that day: step -0.00%, from_pretrained's own peak +0.02% after the fix), and the peak through
#      peft's preparation too (prepared_*), where memfit predicts the fp32 upcast of what was not quantized.
#   3. if time is left: the CPU EMA row (issue 51, cut by that loan's limit), and issue 53's `--batch-size max` on
#      the card (GPT-2, 12 GiB left: batch 6 trains, 7 runs out of memory). FLUX's cases need a loan of their own
#      (tools/gpu/users_session.sh).
#   4. if time is left (issue 49, 2026-12-06): a LoRA over transformers' fine-grained FP8 load of Llama-2-7B sizes
#      (bench.qlora_load_gpu --format fp8), against the blind prediction in tools/gpu/fp8_7b_predicted.json
#      (memfit's float8 layer standing in for FP8Linear: NOTE [ FP8 checkpoints by card ]).
# Before the call, here: bitsandbytes, diffusers, peft, importlib_metadata wheels in .whl (finetune_session.sh's list).
#   run(command="bash tools/gpu/next_loan.sh $(git rev-parse --short HEAD) 2>&1 | tee $OUT/log.txt",
#       carry=[".whl"], timeout_s=600)
# Then: offload and migration rows to bench/results/, qlora_load.jsonl to tests/data/h200_qlora_load.jsonl (or an h100 file),
# gt.jsonl to tests/data/h200.jsonl with "host" (the probe in $OUT/host.json says which machine).
END_SECONDS=${END_SECONDS:-570}; source tools/gpu/session_env.sh "$1"
el "offload llama4-offopt (and its device step)"
timeout 170 python3 -m bench.offload_gpu --only llama4-offopt --repeats 6 --out $OUT/offload.jsonl 2>&1 | grep -v Warning | tail -20
el "paged states' migration"; timeout 100 python3 -m tools.gpu.migration_probe --out $OUT/migration.jsonl \
  --preset $([ "$CARD" = h100 ] && echo h100-80gb || echo h200-141gb) 2>&1 | grep -v Warning | tail -5
el "compiled rows alone"; python3 -m tools.gpu.ground_truth --cases tools/gpu/alone_cases.json --out $OUT/alone.jsonl \
  --timeout 90 --deadline $(( $(left) - 220 ))
python3 -m tools.gpu.compare_blind $OUT/alone.jsonl tools/gpu/alone_predicted.jsonl --card $CARD
if [ "$(left)" -gt 160 ]; then
  el "qlora load 7b"; timeout 150 python3 -m bench.qlora_load_gpu --size 7b --out $OUT/qlora_load.jsonl
  python3 -m bench.qlora_load_gpu --blind $OUT/qlora_load.jsonl tools/gpu/qlora7b_predicted.json \
    --preset $([ "$CARD" = h100 ] && echo h100-80gb || echo h200-141gb)
fi
if [ "$(left)" -gt 130 ]; then
  el "offload gpt2-ema-cpu"; timeout $(( $(left) - 10 )) python3 -m bench.offload_gpu --only gpt2-ema-cpu --repeats 6 \
    --out $OUT/offload_ema.jsonl 2>&1 | grep -v Warning | tail -12
fi
CASES=tools/gpu/users_cases.json
if [ "$(left)" -gt 70 ]; then
  el "batch max"; python3 -m tools.gpu.ground_truth --cases $CASES --only "^m-" --out $OUT/gt.jsonl --timeout 60 \
    --deadline $(( $(left) - 40 ))
  python3 -m tools.gpu.compare_blind $OUT/gt.jsonl $(predicted users) --card $CARD
fi
if [ "$(left)" -gt 150 ]; then
  el "fp8 load 7b"; timeout 140 python3 -m bench.qlora_load_gpu --size 7b --format fp8 --out $OUT/fp8_load.jsonl
  python3 -m bench.qlora_load_gpu --blind $OUT/fp8_load.jsonl tools/gpu/fp8_7b_predicted.json \
    --preset $([ "$CARD" = h100 ] && echo h100-80gb || echo h200-141gb)
fi
el done
