#!/usr/bin/env bash
# The README's main job: sets up (or reuses) the environment, generates the embedded data,
# calibrates LATTE on the default model, evaluates exact vs linearized with mmdet's
# CocoMetric, then re-evaluates the calibrated checkpoint with mmdet's own tools/test.py.
#   bash tools/demo.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv="$(bash tools/setup_env.sh | tail -n 1)"
py="$venv/bin/python"
cfg="${LATTE_DEMO_CONFIG:-configs/mmdet/detr_tiny_latte_synthetic.py}"
work="${LATTE_DEMO_WORK_DIR:-work_dirs/demo}"
"$py" -m latte_plugin.data.synthetic data/synthetic --train 64 --val 32 --size 256
"$py" tools/calibrate.py "$cfg" --work-dir "$work" --eval
mmdet_test="$("$py" -c 'import mmdet, os; print(os.path.join(os.path.dirname(mmdet.__file__), ".mim", "tools", "test.py"))')"
echo "== mmdet's own tools/test.py on the calibrated checkpoint (no recalibration) =="
"$py" "$mmdet_test" "$cfg" "$work/latte_calibrated.pth" --work-dir "$work/mmdet_test" 2>&1 | grep -E "bbox_mAP|latte" || true
