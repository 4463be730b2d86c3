#!/bin/sh
# The engine on pjrt answers as on cpu-flash: the same greedy text from the default model, with
# attention compiled by the PJRT plugin. Exit 77 (skipped) when the plugin or the model is absent.
#   generate_matches.sh KALLPA PLUGIN MODEL
kallpa="$1" plugin="$2" model="$3"
[ -f "$plugin" ] || { echo "skipped: $plugin is absent (run scripts/fetch_pjrt.sh)"; exit 77; }
[ -f "$model" ] || { echo "skipped: $model is absent (run scripts/fetch_model.sh)"; exit 77; }
run() { "$kallpa" generate -m "$model" --temp 0 -n 40 -p "Once upon a time" --strict "$@"; }
want="$(run --attention cpu-flash)" || exit 1
got="$(run --attention pjrt --pjrt-plugin "$plugin")" || exit 1
echo "cpu-flash: $want"
echo "pjrt:      $got"
[ -n "$want" ] && [ "$want" = "$got" ]
