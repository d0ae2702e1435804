#!/usr/bin/env bash
# The AVX-512 / AVX512-VNNI / AVX-VNNI kernel paths on a CPU without them, through SIMDe emulation:
# a copy of the checkout built with every AVX-512 or AVX-VNNI target replaced by AVX2 + SIMDe
# (.ci/emu512.h), then the instruction-set tests at the emulated level. Minutes, not for CI: run it
# after changing a kernel on an AVX2-only machine.
#
#   .ci/emulate_isa.sh [--sanitize] [pytest args...]    (default: the instruction-set tests)
#
# --sanitize adds ASan + UBSan (-O1). BRISK_EMU_FLAGS sets what the emulated CPU reports (default:
# a server core with AVX-512, AVX512-VNNI and AVX-VNNI).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
san=0
if [[ "${1:-}" == "--sanitize" ]]; then san=1; shift; fi
[[ -f /usr/include/simde/x86/avx512.h ]] || { echo "needs SIMDe: apt-get install libsimde-dev" >&2; exit 2; }
work="$(mktemp -d /tmp/brisk-emu.XXXXXX)"
git -C "$root" ls-files -z --cached --others --exclude-standard | (cd "$root" && xargs -0 cp --parents -t "$work")
cp "$root/.ci/emu512.h" "$work/brisk/kernels/emu512.h"
sed -i -E 's/target\("[^"]*(avx512|avxvnni)[^"]*"\)/target("avx2,fma,f16c")/' "$work"/brisk/kernels/*.cpp \
  "$work"/brisk/kernels/*.h "$work"/brisk/kernels/*.inc
flags="\"-O1\", \"-g\", \"-fopenmp\", \"-mavx2\", \"-mfma\", \"-mf16c\", \"-include\", \"$work/brisk/kernels/emu512.h\""
link="\"-fopenmp\""
if (( san )); then
  flags+=", \"-fsanitize=address,undefined\", \"-fno-sanitize-recover=undefined\", \"-fno-omit-frame-pointer\""
  link+=", \"-fsanitize=address,undefined\""
fi
sed -i "s#extra_compile_args=\[[^]]*\]#extra_compile_args=[$flags]#; s#extra_link_args=\[[^]]*\]#extra_link_args=[$link]#" "$work/setup.py"
grep -q "emu512.h" "$work/setup.py" || { echo "setup.py's compile flags were not found to patch" >&2; exit 2; }
(cd "$work" && MAX_JOBS="${MAX_JOBS:-2}" python setup.py -q build_ext --inplace > build.log 2>&1) \
  || { tail -20 "$work/build.log"; exit 1; }
if (( san )); then
  export LD_PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)"
  export ASAN_OPTIONS=detect_leaks=0:halt_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
fi
export BRISK_EMU_FLAGS="${BRISK_EMU_FLAGS:-avx512f,avx512bw,avx512vl,avx512vnni,avxvnni}"
cd "$work"
python -c "from brisk import kernels; print('emulated:', kernels.CAPS.describe())"
if (( $# == 0 )); then set -- tests/quant/test_blocks.py tests/kernels/test_isa_paths.py tests/kernels/test_capability.py; fi
rc=0
PYTHONPATH="$work" python -X faulthandler -m pytest -q -p no:cacheprovider "$@" || rc=$?
echo "copy kept at $work"
exit $rc
