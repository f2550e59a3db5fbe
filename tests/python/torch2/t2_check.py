"""Check a file or folder that statedict wrote against a manifest, with torch 2.x as the reader.

Usage (run with tools/sid-python):
  t2_check.py torch FILE MANIFEST [--no-mmap] [--full] [--check-aliases]
      torch.load(FILE) with torch 2.x's default weights_only=True, then again with mmap=True
      (skip with --no-mmap); --full loads with weights_only=False instead (trusted files only).
  t2_check.py dcp DIR MANIFEST
      dcp.load(no_dist=True) into receivers made from DIR/.metadata (poisoned, so an element
      left unread cannot match), then format_utils.dcp_to_torch_save + torch.load.
  t2_check.py safetensors PATH MANIFEST
      safetensors.safe_open of a .safetensors file, or of every shard of a Hugging Face folder
      (or *.index.json); F4 is reported as safetensors counts it (two values per byte).
      Only the manifest's tensors are compared (safetensors holds no other values); its
      "metadata", when present, is compared with the file's __metadata__.
  t2_check.py hf DIR MANIFEST [--config-from SRC_DIR]
      transformers AutoModelForCausalLM.from_pretrained(DIR) must give the logits recorded in
      MANIFEST["hf"] (sha256 of float32 logits for its input ids). config.json comes from DIR, or
      else from SRC_DIR (default: the manifest's own fixture folder).

Exit status: 0 when everything matches, 1 with one line per problem on stdout, 2 on bad usage.
Tensors are compared by dtype, shape and sha256 and values type-aware, as ../torch_check.py does.
"""
import json
import os
import shutil
import sys
import tempfile
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _t2 as T  # noqa: E402

sys.path.insert(0, os.path.dirname(HERE))
from torch_check import compare_with_manifest  # noqa: E402

warnings.simplefilter("ignore")


def one_line(e):
    """The gist of an exception on one line: torch's WeightsUnpickler reason, the last line of
    each rank's traceback in a CheckpointException, else type and message."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = []
        for rank, f in failures.items():
            exc = f[0] if isinstance(f, tuple) else f
            parts.append(f"rank {rank}: {T.one_line(exc)}")
        return f"{type(e).__name__}: " + "; ".join(parts)[:400]
    msg = T.one_line(e)
    i = msg.find("WeightsUnpickler error:")
    if i >= 0:
        j = msg.find("Check the documentation", i)
        return msg[i:j if j > 0 else None].strip()[:400]
    return msg[:400]


# --------------------------------------------------------------------------- torch
def check_torch(path, manifest, mmap=True, full=False, check_aliases=False):
    import torch
    problems = []
    runs = [("torch.load(weights_only=False)" if full else "torch.load", {"weights_only": not full})]
    if mmap:
        runs.append(("torch.load(mmap=True)", {"weights_only": not full, "mmap": True}))
    for label, kw in runs:
        try:
            obj = torch.load(path, map_location="cpu", **kw)
        except Exception as e:
            problems.append(f"{label} failed: {one_line(e)}")
            continue
        d = T.describe(obj, expand_objects=True)
        problems += [f"{label}: {p}" for p in compare_with_manifest(manifest, d["tensors"], d["values"])]
        if check_aliases:
            for a, b in manifest.get("aliases", {}).items():
                if d["aliases"].get(a) is None:
                    problems.append(f"{label}: {a}: should share storage with {b}, does not")
    return problems


# --------------------------------------------------------------------------- dcp
def dcp_receivers(path):
    """A flat {fqn: receiver} from .metadata: poisoned tensors of the stored dtype and size,
    None for bytes items. Classes are told apart by name, so that a .metadata naming them by
    another module path (torch 1.13's torch.distributed._shard.checkpoint) still gets receivers
    and dcp.load gives its own verdict."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    md = FileSystemReader(path).read_metadata()
    sd = {}
    for fqn, m in md.state_dict_metadata.items():
        if type(m).__name__ == "TensorStorageMetadata":
            t = torch.empty(tuple(m.size), dtype=m.properties.dtype)
            if t.is_floating_point() or t.is_complex():
                t.fill_(float("nan"))
            elif t.numel() and t.dtype == torch.bool:
                t.fill_(True)
            elif t.numel():
                t.fill_(-3 if t.dtype.is_signed else 253)
            sd[fqn] = t
        else:
            sd[fqn] = None
    return sd


def check_dcp(path, manifest):
    import torch
    import torch.distributed.checkpoint as dcp
    problems = []
    try:
        sd = dcp_receivers(path)
        dcp.load(sd, checkpoint_id=path, no_dist=True)
        d = T.describe(sd, expand_objects=True)
        problems += [f"dcp.load(no_dist=True): {p}" for p in compare_with_manifest(manifest, d["tensors"], d["values"])]
    except BaseException as e:            # CheckpointException is a BaseException
        if isinstance(e, KeyboardInterrupt):
            raise
        problems.append(f"dcp.load(no_dist=True) failed: {one_line(e)}")
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "full.pt")
        try:
            dcp_to_torch_save(path, out)
            d = T.describe(torch.load(out, weights_only=False), expand_objects=True)
            problems += [f"dcp_to_torch_save: {p}" for p in compare_with_manifest(manifest, d["tensors"], d["values"])]
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt):
                raise
            problems.append(f"dcp_to_torch_save failed: {one_line(e)}")
    return problems


# --------------------------------------------------------------------------- safetensors
def st_entry(t):
    import torch
    e = T.tensor_entry(t)
    if t.dtype == torch.float4_e2m1fn_x2:            # safetensors counts 4-bit values
        e["dtype"] = "F4"
        e["shape"] = list(t.shape[:-1]) + [t.shape[-1] * 2] if t.dim() else [2]
    return e


def st_files(path):
    if os.path.isfile(path) and not path.endswith(".index.json"):
        return [path]
    index = path
    if os.path.isdir(path):
        cands = sorted(f for f in os.listdir(path) if f.endswith(".safetensors.index.json"))
        if not cands:
            single = os.path.join(path, "model.safetensors")
            if os.path.exists(single):
                return [single]
            raise ValueError(f"{path}: no *.safetensors.index.json and no model.safetensors")
        index = os.path.join(path, cands[0])
    with open(index, encoding="utf-8") as f:
        weight_map = json.load(f)["weight_map"]
    folder = os.path.dirname(index)
    return [os.path.join(folder, n) for n in dict.fromkeys(weight_map.values())]


def check_safetensors(path, manifest):
    from safetensors import safe_open
    problems, tensors, metadata = [], {}, None
    try:
        files = st_files(path)
    except Exception as e:
        return [f"cannot list the safetensors files: {one_line(e)}"]
    for f in files:
        try:
            with safe_open(f, "pt") as st:
                if len(files) == 1:
                    metadata = st.metadata()
                for k in st.keys():
                    if k in tensors:
                        problems.append(f"{k}: in more than one shard")
                    tensors[k] = st_entry(st.get_tensor(k))
        except Exception as e:
            problems.append(f"safe_open({os.path.basename(f)}) failed: {one_line(e)}")
    # safetensors holds tensors only: the manifest's values (a DCP's step, say) are not expected
    problems += compare_with_manifest({"tensors": manifest.get("tensors", {})}, tensors, {})
    if "metadata" in manifest and (metadata or None) != manifest["metadata"]:
        problems.append(f"__metadata__ {json.dumps(metadata)} != expected {json.dumps(manifest['metadata'])}")
    return problems


# --------------------------------------------------------------------------- transformers
def check_hf(path, manifest, config_from=None):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    info = manifest.get("hf")
    if not info:
        return ["the manifest has no \"hf\" entry"]
    with tempfile.TemporaryDirectory() as tmp:
        folder = path
        if not os.path.exists(os.path.join(path, "config.json")):
            src = config_from or os.path.join(os.path.dirname(os.path.abspath(manifest["_file"])), manifest["path"])
            folder = os.path.join(tmp, "model")
            os.makedirs(folder)
            for f in os.listdir(path):
                os.symlink(os.path.abspath(os.path.join(path, f)), os.path.join(folder, f))
            for f in ("config.json", "generation_config.json"):
                if os.path.exists(os.path.join(src, f)):
                    shutil.copy(os.path.join(src, f), folder)
        try:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        except Exception as e:
            return [f"from_pretrained failed: {one_line(e)}"]
    if type(model).__name__ != info["model_class"]:
        return [f"from_pretrained built {type(model).__name__}, expected {info['model_class']}"]
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor(info["input_ids"])).logits.float()
    sha = T.C.sha256_hex(T.strided_bytes(logits))
    if sha != info["logits_sha256"]:
        return [f"logits differ from the source model's (sha256 {sha} != {info['logits_sha256']})"]
    return []


# --------------------------------------------------------------------------- main
def main(argv):
    args = argv[1:]
    flags = {a for a in args if a in ("--no-mmap", "--full", "--check-aliases")}
    args = [a for a in args if a not in flags]
    config_from = None
    if "--config-from" in args:
        i = args.index("--config-from")
        if i + 1 >= len(args):
            print("--config-from needs a folder", file=sys.stderr)
            return 2
        config_from = args[i + 1]
        del args[i:i + 2]
    if len(args) != 3 or args[0] not in ("torch", "dcp", "safetensors", "hf") or \
            any(a.startswith("--") for a in args):
        print(__doc__.strip().split("\n\n")[1], file=sys.stderr)
        return 2
    mode, path, manifest_path = args
    try:
        manifest = T.C.load_manifest(manifest_path)
    except Exception as e:
        print(f"cannot read the manifest {manifest_path}: {e}", file=sys.stderr)
        return 2
    manifest["_file"] = manifest_path
    if not os.path.exists(path):
        print(f"{path}: no such file or folder", file=sys.stderr)
        return 2
    if mode == "torch":
        problems = check_torch(path, manifest, mmap="--no-mmap" not in flags, full="--full" in flags,
                               check_aliases="--check-aliases" in flags)
    elif mode == "dcp":
        problems = check_dcp(path, manifest)
    elif mode == "safetensors":
        problems = check_safetensors(path, manifest)
    else:
        problems = check_hf(path, manifest, config_from)
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
