#!/usr/bin/env bash
# The README's main job: sets up (or reuses) the environment, generates the embedded data,
# runs every LATTE row on the committed embedded checkpoint (calibrate + CocoMetric), then
# re-evaluates the calibrated `latte` checkpoint with mmdet's own tools/test.py.
#   bash tools/demo.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv="$(bash tools/setup_env.sh | tail -n 1)"
py="$venv/bin/python"
cfg="${LATTE_DEMO_CONFIG:-configs/mmdet/embedded/cond_detr_r18_synthetic_latte.py}"
ckpt="${LATTE_DEMO_CHECKPOINT:-checkpoints/cond_detr_r18_synthetic.pth}"
work="${LATTE_DEMO_WORK_DIR:-work_dirs/main_job}"
"$py" -m latte_plugin.data.synthetic data/synthetic --train 4000 --val 300 --size 256
"$py" tools/main_job.py --config "$cfg" --checkpoint "$ckpt" --work-dir "$work" 2>&1 \
  | grep -vE "^(WARNING|  warnings.warn)|DeprecationWarning|UserWarning"
mmdet_test="$("$py" -c 'import mmdet, os; print(os.path.join(os.path.dirname(mmdet.__file__), ".mim", "tools", "test.py"))')"
echo "== mmdet's own tools/test.py on $work/latte_calibrated.pth (no recalibration) =="
"$py" "$mmdet_test" "$cfg" "$work/latte_calibrated.pth" --work-dir "$work/mmdet_test" 2>&1 \
  | grep -E "coco/bbox_mAP:|\[latte\] using" || { echo "tools/test.py failed"; exit 1; }
