#!/usr/bin/env bash
# The defaults on a split no choice in the project has seen: data generated with another seed
# (7: 400 train, 500 val images), calibrated on its train split, scored on its val split with
# CocoMetric, for both embedded models.
#   bash tools/evidence/fresh_split.sh                       # work_dirs/fresh_split/
#   LATTE_DEMO_RESULTS=results bash tools/evidence/fresh_split.sh   # also rewrites results/fresh_split_*.json
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
venv="$(bash tools/setup_env.sh | tail -n 1)"
py="$venv/bin/python"
data=data/synthetic_seed7
"$py" -m latte_plugin.data.synthetic "$data" --train 400 --val 500 --size 256 --seed 7 >/dev/null
for model in cond_detr rtdetr; do
  case "$model" in
    cond_detr) cfg=configs/mmdet/embedded/cond_detr_r18_synthetic_latte.py; ckpt=checkpoints/cond_detr_r18_synthetic.pth ;;
    rtdetr) cfg=configs/mmdet/embedded/rtdetr_r18_synthetic_latte.py; ckpt=checkpoints/rtdetr_r18_synthetic.pth ;;
  esac
  echo "== $model on $data =="
  PYTHONWARNINGS=ignore "$py" tools/evidence/main_job.py --config "$cfg" --checkpoint "$ckpt" --data-root "$data" \
    --work-dir "work_dirs/fresh_split/$model" --rows exact latte qtvit ours:auto 'ours:auto@83%' 'ours:target=5%' \
    ${LATTE_DEMO_RESULTS:+--results "$LATTE_DEMO_RESULTS/fresh_split_$model.json"}
done
