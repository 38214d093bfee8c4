"""benchmarks/e2e/fsdp_param_views.py: the traced shapes it reports, against the block's own sizes."""

from benchmarks.e2e import fsdp_param_views


def test_flat_views_turn_the_modulation_table_symbolic_where_parameters_and_compile_blocks_keep_it_static():
    dim, tokens = 24, 10
    params = fsdp_param_views.traced_inputs(False, dim, tokens)
    views = fsdp_param_views.traced_inputs(True, dim, tokens)
    fixed = fsdp_param_views.traced_inputs(True, dim, tokens, compile_blocks=True)
    modulation = lambda inputs: next(v for k, v in inputs.items() if "modulation" in k)  # noqa: E731
    assert modulation(params) == ["1", "6", str(dim)]
    assert modulation(views)[0] == "1" and not modulation(views)[1].isdigit() and modulation(views)[2] == str(dim)
    assert modulation(fixed) == ["1", "6", str(dim)]  # compile_blocks keeps the views' sizes static
    # the tokens are dynamic in both (dynamic=True), never the batch of one
    for inputs in (params, views, fixed):
        x = next(v for k, v in inputs.items() if k.startswith("l_x"))
        assert x[0] == "1" and not x[1].isdigit() and x[2] == str(dim)
