"""AdaLN idioms in forwards no pattern knows, recognised in their source and rewritten to the fused op
(docs/surgery.md, "Idioms: AdaLN in code we have never seen").

Flow, for a module no pattern fuses (run_surgery calls `IdiomRecogniser(module, name, report, dry_run)`):

    recogniser.py   IdiomRecogniser: per class (cached for one apply_fused_adaln call) a ForwardAnalysis;
                    per instance the norm checks, per site verify.check_site; binds the rewritten forward,
                    its first eager call compared with the original (verify.FirstCallCheck)
    rewrite.py      ForwardAnalysis: parse `forward`, visit its expressions, replace each match by
                    `_fused_adaln_sites[k](leaves...)`, compile with the forward's globals and closure
    single_use.py   single_use_defs: `h = self.norm(x)` read once later, foldable into that site
    matcher.py      Matcher.match(expr) -> Match (leaves by role, casts, form); cast_of, norm_call
    scope.py        Scope: what a name means in the forward; inline_helper: `modulate(...)` expanded
    runtime.py      FusedSite, Cast: what runs at each forward call of a rewritten site

Each module imports only modules listed below it (tests/test_layers.py); `IdiomRecogniser` is the
package's one name used outside it.
"""
from lightning_adaptiveload.surgery.idioms.recogniser import IdiomRecogniser

__all__ = ["IdiomRecogniser"]
