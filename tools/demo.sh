#!/usr/bin/env bash
# The README's main job: sets up (or reuses) the environment, generates the embedded data, and
# for each embedded model (Conditional DETR, RT-DETR) runs every LATTE row on the committed
# checkpoint (calibrate + CocoMetric), then re-evaluates the saved default-row checkpoint with
# mmdet's own tools/test.py, exports it to ONNX and evaluates it through onnxruntime; last, the
# generic entry on the non-detection model (tools/sequence_job.py).
#   bash tools/demo.sh                 # both models
#   LATTE_DEMO_MODELS=rtdetr bash tools/demo.sh
#   LATTE_DEMO_RESULTS=results bash tools/demo.sh   # also rewrites the committed results/ files
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv="$(bash tools/setup_env.sh | tail -n 1)"
py="$venv/bin/python"
"$py" -m latte_plugin.data.synthetic data/synthetic --train 4000 --val 300 --size 256 >/dev/null
mmdet_test="$("$py" -c 'import mmdet, os; print(os.path.join(os.path.dirname(mmdet.__file__), ".mim", "tools", "test.py"))')"
for model in ${LATTE_DEMO_MODELS:-cond_detr rtdetr}; do
  case "$model" in
    cond_detr) cfg=configs/mmdet/embedded/cond_detr_r18_synthetic_latte.py; ckpt=checkpoints/cond_detr_r18_synthetic.pth ;;
    rtdetr) cfg=configs/mmdet/embedded/rtdetr_r18_synthetic_latte.py; ckpt=checkpoints/rtdetr_r18_synthetic.pth ;;
    *) echo "unknown model $model (cond_detr, rtdetr)"; exit 2 ;;
  esac
  work="${LATTE_DEMO_WORK_DIR:-work_dirs/main_job}/$model"
  echo "== $model: $cfg on $ckpt =="
  # progress bars, the table and the paths on the console; the frameworks' logs in $work/main_job.log
  PYTHONWARNINGS=ignore "$py" tools/main_job.py --config "$cfg" --checkpoint "$ckpt" --work-dir "$work" \
    ${LATTE_DEMO_RESULTS:+--results "$LATTE_DEMO_RESULTS/main_job_$model.json"}
  echo "== mmdet's own tools/test.py on $work/latte_calibrated.pth (no recalibration; log: $work/mmdet_test.log) =="
  mkdir -p "$work"
  PYTHONWARNINGS=ignore "$py" "$mmdet_test" "$cfg" "$work/latte_calibrated.pth" --work-dir "$work/mmdet_test" \
    >"$work/mmdet_test.log" 2>&1 || { tail -n 20 "$work/mmdet_test.log"; echo "tools/test.py failed"; exit 1; }
  grep -oE "\[latte\] using.*|coco/bbox_mAP: [0-9.]+" "$work/mmdet_test.log" | sort -u
  echo "== ONNX: export $work/latte_calibrated.pth, CocoMetric through onnxruntime vs torch =="
  PYTHONWARNINGS=ignore "$py" tools/export_onnx.py "$cfg" "$work/latte_calibrated.pth" --out "$work/$model.onnx" \
    --eval ${LATTE_DEMO_RESULTS:+--results "$LATTE_DEMO_RESULTS/onnx_$model.json"}
done
echo "== beyond detectors: the retrieval encoder through latte_plugin.linearize =="
PYTHONWARNINGS=ignore "$py" tools/sequence_job.py ${LATTE_DEMO_RESULTS:+--results "$LATTE_DEMO_RESULTS/sequence_job.json"}
