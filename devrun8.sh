python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
timeout 170 python3 -m pytest tests/gpu/test_decode_graphs_cuda.py -q -p no:cacheprovider -rA -k "split_misses or stream_memops or graph_tokens_equal_eager_tokens" 2>&1 | grep -E "PASSED|FAILED|ERROR|Error" > $OUT/tests-gpu-review.txt; echo "exit status ${PIPESTATUS[0]}" >> $OUT/tests-gpu-review.txt; cat $OUT/tests-gpu-review.txt
