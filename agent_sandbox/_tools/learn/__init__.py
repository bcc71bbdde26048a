"""Learning mode: from what a run needed to a proposed policy a person reviews.

Learning mode answers "what does this tool need?" by observation, and observation is the
weak point: the code being observed is not trusted, and whatever it does while learning
could become the next run's permissions. This package is written against that. It trusts
nothing the run did beyond the bare fact that it tried an operation, and it never changes a
policy by itself.

1. **The envelope** (`observe`: `learning_envelope`, `learn_run`, `Learner`). A learning
   run is the tool's policy switched to `mode = "learn"` (the Python guards record each
   operation they would refuse and let it proceed), run under a kernel provider when one is
   available (`auto`, reported) or the one named (an error when it is unavailable). Writes
   stay limited to the scratch directory and the declared write paths, the network to the
   declared rules, and secret-looking variables are not passed: the envelope never widens
   the policy it starts from.
2. **The proposal** (`propose`, judging paths in `paths` and hosts in `net`, with the
   tables of what is never proposed in `findings`). Only records marked `learned` count.
   Each becomes a proposed entry, a RISKY proposed entry (marked on its line and listed
   first), or a FLAGGED observation that is not proposed, with the reason. Paths are judged
   on their real target after resolving symlinks; a path reached through a link the run
   could have planted (scratch, a writable or world-writable directory) is flagged, not
   proposed. Paths are proposed file by file; a directory only when `DIR_MIN_FILES` files
   directly in it were used and the directory is not a system, home, scratch or
   world-writable one. Never proposed: `/`, `/proc`, `/sys`, `/dev` (beyond a few harmless
   devices), `/run`, the policy file and its proposal, a parent of the home directory, the
   worker's control and scratch directories, sensitive files, `.pth`/`sitecustomize` files
   or writes into an import root, loader and interpreter variables, native-code and
   dynamic-code calls, and anything the current policy denies explicitly. Re-learning the
   same records gives the same proposal, byte for byte.
3. **Review** (`review`: `write_proposal`, `diff_policies`, `apply_proposal`). The
   proposal is written beside the policy as `<name>.proposed.toml` plus
   `<name>.proposed.diff`, never through a symlink. Applying it is a separate, explicit step.

The package's `__init__` re-exports nothing: import from the module that holds a name.
"""

__all__: list[str] = []
