python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:packages/veomni-core/src:packages/veomni-kernels/src:packages/veomni-models/src:packages/veomni-train/src
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/train/test_host_sync.py tests/train/test_cuda_graphs.py -k gpu 2>&1 | grep -v "^DEBUG\|^INFO\|^WARNING" | grep -E "^E |passed|failed|^FAILED|Error" | head -30
timeout 380 python3 tools/bench/bench_e2e.py --out $OUT/t1_graphs.json --hf-master bf16 --steps 16 --warmup 8 --contenders veomni_plain_compiled,veomni_compiled,veomni_plain_compiled_graphs,veomni_plain_graphs,veomni_compiled_graphs 2>&1 | grep -v Warning | tail -16
