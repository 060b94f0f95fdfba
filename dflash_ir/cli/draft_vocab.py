"""`dflash-draft-vocab`: give a DFlash draft its own reduced output head (llama.cpp's d2t).

    dflash-draft-vocab draft.gguf target.gguf --size 32768 --text answers.txt -o draft-32k.gguf
    dflash-draft-vocab draft-32k.gguf target.gguf --size 0 -o draft.gguf     # the whole head again

The head keeps the target tokens most frequent in the texts (tokenized by the target's
tokenizer) and the end-of-generation token; rows are copied from the target's head as
stored. A draft block then multiplies by that many rows instead of the whole vocabulary
(Qwen3.5: 248320), which is most of its cost on a CPU. Output is unchanged: the target
verifies every proposal. Texts the target itself wrote, of the kind you will ask for, give
the highest acceptance.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dflash_ir.errors import DflashError

from .args import add_quiet, integer, progress_printer


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-draft-vocab", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("draft", help="DFlash draft GGUF")
    p.add_argument("target", help="its target GGUF (the head's rows and the tokenizer)")
    p.add_argument("--size", type=integer(0), required=True, help="tokens in the draft's head; 0 = none of its own "
                   "(it borrows the target's whole head, as drafts without d2t do)")
    p.add_argument("--text", nargs="+", default=[], metavar="FILE",
                   help="UTF-8 texts whose token counts rank the vocabulary (needed unless --size 0)")
    p.add_argument("-o", "--output", required=True, help="the draft GGUF to write (not one of the inputs)")
    add_quiet(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    say = progress_printer("dflash-draft-vocab", args.quiet)
    out = Path(args.output)
    if out.exists() and any(out.resolve() == Path(f).resolve() for f in (args.draft, args.target)):
        print(f"dflash-draft-vocab: error: -o {out} is one of the inputs", file=sys.stderr)
        return 2
    if args.size and not args.text:
        print("dflash-draft-vocab: error: --text is needed to choose the tokens (or --size 0)", file=sys.stderr)
        return 2
    try:
        write_reduced(Path(args.draft), Path(args.target), args.size, [Path(t) for t in args.text], out, say)
    except (DflashError, OSError, UnicodeDecodeError, ValueError) as e:
        print(f"dflash-draft-vocab: error: {e}", file=sys.stderr)
        return 1
    return 0


def write_reduced(draft: Path, target: Path, size: int, texts: list[Path], out: Path, say) -> None:
    from dflash_ir.models.config import DraftConfig, TargetConfig
    from dflash_ir.models.draft_vocab import without_reduced_vocab, write_frequent_head
    from dflash_ir.models.generator import write_gguf
    from dflash_ir.models.gguf_file import open_gguf
    from dflash_ir.models.tokenizer import Tokenizer

    d, t = open_gguf(draft), open_gguf(target)
    DraftConfig.from_gguf(d)
    vocab = TargetConfig.from_gguf(t).vocab_size
    if size > vocab:
        raise ValueError(f"--size {size} is more than the target's {vocab} tokens")
    if not size:
        write_gguf(out, without_reduced_vocab(d))
        say(f"wrote {out}: the draft borrows the target's whole head")
        return
    tokenizer = Tokenizer.from_gguf(target)
    tokens = []
    for path in texts:
        ids = tokenizer.encode(path.read_bytes().decode("utf-8"))
        say(f"{path}: {len(ids)} tokens")
        tokens += ids
    rows, share = write_frequent_head(d, t, tokens, size, out, always=[tokenizer.eos_id])
    say(f"wrote {out}: a head of {rows} of {vocab} tokens, holding {share:.2%} of the texts' tokens")


if __name__ == "__main__":
    raise SystemExit(main())
