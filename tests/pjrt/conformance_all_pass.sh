#!/bin/sh
# kallpa conformance --backend pjrt --quick on one PJRT plugin: passes when every case ran and
# passed (none failed, none skipped). Exit 77 (skipped) when the plugin is absent.
#   conformance_all_pass.sh KALLPA PLUGIN
kallpa="$1" plugin="$2"
[ -f "$plugin" ] || { echo "skipped: $plugin is absent (run scripts/fetch_pjrt.sh)"; exit 77; }
out="$("$kallpa" --pjrt-plugin "$plugin" conformance --backend pjrt --quick 2>&1)"
rc=$?
echo "$out" | tail -n 5
[ "$rc" -eq 0 ] || exit 1
echo "$out" | grep -Eq '^pjrt +[0-9]+ +[0-9]+ +0 +0 ' || { echo "FAIL: some cases failed or were skipped"; exit 1; }
