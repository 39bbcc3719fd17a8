#!/bin/bash
# The next 15-minute loan, prepared (2026-12-04): what the loan of that day left unmeasured, in the guide's order
# (issue 52 compiled steps, then issue 49 loads), each case's row kept even when memfit's own prediction after it
# runs past the timeout:
#   1. issue 52's four GPT-2 compiled rows lost that day (blocks, full + budget 0.5 and 0.1, full + bf16-pure +
#      8 chunks) and GPT-2 compile: full again (next_loan_cases.json, -rule): that day's row measured 7.24 GB
#      against 6.37 predicted here, because pad_mm's timing padded all three vocabulary matmuls on that H200;
#      memfit's compiled regions now pad by the prediction's rule (NOTE [ Padded matmuls without timing ]), so
#      it must come within 3% of 6.37 GB; 3 overlapping their CPU work, each alone on the GPU, predicted there
#      too (--predict);
#   2. issue 49: QLoRA as users load it (bench.qlora_load_gpu; its checkpoint made on the GPU, in /dev/shm);
#   3. issue 52's seed case (Lumina2 LoRA, compiled blocks + budget 0.5, batch 2, 24 GiB left), if 150 s are left.
# Blind predictions, committed first: tools/gpu/compile_blind_predicted.jsonl (torch 2.14, this machine's) and
# compile_t211_predicted*.jsonl (torch 2.11, the device's, in a second environment here: Inductor compiles GPT-2's
# chunked loss otherwise in the two, 4.31 GB against 5.86 GB for -purebf16-full-chunks8). The host is measured first
# (session_env.sh: $OUT/host.json). Before the call, here: bitsandbytes, diffusers, peft, importlib_metadata
# wheels in .whl (finetune_session.sh's list).
#   run(command="bash tools/gpu/next_loan.sh $(git rev-parse --short HEAD) 2>&1 | tee $OUT/log.txt",
#       carry=[".whl"], timeout_s=600)
# Then: append $OUT/*.jsonl rows to tests/data/h200.jsonl (or h100.jsonl) with "host" if the probe says the
# machine is not a known one (memfit.hosts), and compare with the committed predictions.
END_SECONDS=${END_SECONDS:-570}; source tools/gpu/session_env.sh "$1"
el "gpt2 compiled"; python3 -m tools.gpu.ground_truth --cases tools/gpu/next_loan_cases.json --jobs 3 --predict \
  --preset none --out $OUT/compile.jsonl --timeout 200 --deadline $(( $(left) - 330 ))
python3 -m tools.gpu.compare_blind $OUT/compile.jsonl $(predicted compile_blind) --card $CARD
echo "against the same cases predicted here with the device's torch 2.11 (compile_t211_predicted*.jsonl):"
python3 -m tools.gpu.compare_blind $OUT/compile.jsonl $(predicted compile_t211) --card $CARD
if [ "$(left)" -gt 80 ]; then
  q=$(( $(left) - 10 )); [ $q -gt 160 ] && q=160
  el "qlora load"; timeout $q python3 -m bench.qlora_load_gpu --preset h200-141gb --out $OUT/qlora_load.jsonl
fi
if [ "$(left)" -gt 150 ]; then
  el "seed case"; python3 -m tools.gpu.ground_truth --cases tools/gpu/compile_blind_cases.json --only "^b-lumina2" --preset none \
    --out $OUT/seed.jsonl --timeout $(( $(left) - 15 ))
  for f in compile_blind compile_t211; do python3 -m tools.gpu.compare_blind $OUT/seed.jsonl $(predicted $f) --card $CARD; done
fi
el done
