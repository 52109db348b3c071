"""Documents inside a sample (``--reset-position-ids --reset-attention-mask``) under TP + SP and
PP: 5 training steps on mock data (whose samples cross document ends) equal one process's, for
learned and rotary positions; and the resets change the run (the data does hold EODs)."""

import pytest

from tests.helpers.dist import run_distributed
from tests.helpers.tiny import tiny_config
from tests.parallel.test_pp_train import _check, _norms


def _cfg(pos_type, docs=True, **parallel):
    # vocab 32: the mock documents count modulo 32, so every 33-token sample holds the EOD id 31;
    # padded to 32 by one process and by TP 2 alike (the same model)
    return tiny_config(
        model=dict(
            num_layers=4,
            num_query_groups=2,
            position_embedding_type=pos_type,
            vocab_size=32,
            make_vocab_size_divisible_by=16,
        ),
        optim=dict(clip_grad=0.05),
        data=dict(reset_position_ids=docs, reset_attention_mask=docs),
        parallel=parallel,
    )


@pytest.mark.parametrize("pos_type", ["learned_absolute", "rope"])
def test_documents_under_pp_tp_sp_match_one_process(pos_type):
    ref = run_distributed(_norms, 1, _cfg(pos_type))[0]
    plain = run_distributed(_norms, 1, _cfg(pos_type, docs=False))[0]
    assert ref[0][0] != plain[0][0]  # the first forward already differs: EODs inside samples
    par = dict(pipeline_model_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True)
    got = run_distributed(_norms, 4, _cfg(pos_type, **par))
    assert all(g == got[0] for g in got)
    _check(got[0], ref)
