#!/bin/bash
# The outer collectives of elastic replicas compared end to end (docs/BENCHMARKS.md §11): torchft's gloo pairs,
# dilocox's authenticated mesh, and the mesh encrypted; alternated, twice each, behind the guarded lighthouse.
#   bash tools/elastic_collectives.sh      (about 4 minutes; run dirs under /tmp/elb-*)
cd "$(dirname "$0")/.."
for i in 1 2; do
  for kind in gloo authenticated encrypted; do
    extra="--outer.elastic.collectives=$kind"
    [ $kind = encrypted ] && extra="--outer.elastic.collectives=authenticated --security.encrypt=true"
    d=/tmp/elb-$kind-$i; rm -rf $d
    timeout 600 python -m dilocox.cli launch --elastic 2 --no-netns configs/tiny-dilocox-paper.yaml --log.run_dir=$d \
      --parallel.pipeline=1 --train.steps=200 --outer.sync_every=10 --train.eval_every=0 $extra > $d.log 2>&1
    echo "$kind $i rc $? $(grep -h '^done' $d/replica0.log | sed 's/.*loss //') | $(grep -h '^done' $d/replica1.log | sed 's/.*ppl [0-9.]*), //')"
  done
done
