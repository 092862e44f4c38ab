# Sourced by the device scripts. variant NAME TARBALL PREFER_KEYS: the module of TARBALL in
# /tmp/NAME, its decoding kernel taking chunks of up to PREFER_KEYS keys (0: none, the forward
# tiles for every split, as main before it). The FA3 wheel in /tmp/w.
variant() {
  rm -rf /tmp/$1; mkdir -p /tmp/$1; tar xJf .carry/$2 -C /tmp/$1
  python3 - "$1" "$3" <<'PY'
import json, sys
p = f"/tmp/{sys.argv[1]}/jax_flash/kernel_configs.json"
t = json.load(open(p))
for d in t["sm90"]["forward"]["decode"]["head_dims"]:
  if sys.argv[2] != "keep":
    d["prefer_keys_up_to"] = int(sys.argv[2])
json.dump(t, open(p, "w"), indent=1)
PY
}
rm -rf /tmp/w
python3 -m pip install -q --no-index --no-deps --target /tmp/w .whl/*.whl
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
