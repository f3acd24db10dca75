"""The SP loss on a Transformers model: shift_labels win over labels, a MoE router's load-balancing loss
is added as the model adds it (from tiled MoE blocks too), and one of another form is refused by name.
Single process (no SP group): the SP loss is then the plain token mean, checked against cross-entropy on
the model's own logits."""

import pytest
import torch
import torch.nn.functional as F

from ds_ulysses import enable_sp_loss, tiled_causal_lm_loss, tile_mlps, untile_mlps
from ds_ulysses.hf.loss import disable_sp_loss
from ds_ulysses.hf.router_loss import router_logits_tiles
from tests.support.models import rel_err, tiny_config, tiny_model


@pytest.mark.parametrize("loss_fn", [None, tiled_causal_lm_loss(3)], ids=["logits", "tiled"])
def test_a_batch_with_labels_and_shift_labels_trains_on_shift_labels(loss_fn):
    model = tiny_model(tiny_config("cohere", logit_scale=0.5))
    ids = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    shift = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    want = F.cross_entropy(logits.flatten(0, 1), shift.flatten(), ignore_index=-100)
    enable_sp_loss(model, loss_fn=loss_fn)
    with torch.no_grad():
        got = model(input_ids=ids, labels=ids, shift_labels=shift).loss
    assert rel_err(got, want) <= 1e-6


def _moe(router_loss: bool = True):
    return tiny_model(tiny_config("mixtral", num_local_experts=4, num_experts_per_tok=2,
                                  output_router_logits=router_loss, router_aux_loss_coef=0.5))


@pytest.mark.parametrize("loss_fn", [None, tiled_causal_lm_loss(3)], ids=["logits", "tiled"])
def test_a_router_load_balancing_loss_is_the_models_own_gradients_included(loss_fn):
    """Mixtral's own loss from labels is CE + coef x its router loss over the unmasked tokens; the SP loss
    (one process: the whole sequence) adds the same term, also when the tiled loss runs the decoder itself."""
    model = _moe()
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # right padding, labelled -100
    labels = ids.masked_fill(mask == 0, -100)
    own = model(input_ids=ids, attention_mask=mask, labels=labels)
    assert own.aux_loss > 0.5 and own.loss.item() - own.aux_loss.item() * 0.5 > 0
    want = [g.clone() for g in torch.autograd.grad(own.loss, list(model.parameters()))]
    enable_sp_loss(model, loss_fn=loss_fn)
    shift = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], dim=1)
    got = model(input_ids=ids, attention_mask=mask, shift_labels=shift)
    assert rel_err(got.loss, own.loss) <= 1e-6 and rel_err(got.aux_loss, own.aux_loss) <= 1e-6
    grads = torch.autograd.grad(got.loss, list(model.parameters()))
    assert max(rel_err(g, w, 1e-8) for g, w in zip(grads, want)) <= 1e-5
    disable_sp_loss(model)


def test_a_router_loss_of_another_form_is_refused_naming_the_function(monkeypatch):
    import transformers.models.mixtral.modeling_mixtral as mixtral

    monkeypatch.setattr(mixtral, "load_balancing_loss_func", lambda gates, experts, top_k, mask: torch.tensor(1.0))
    function = r"\(transformers.models.mixtral.modeling_mixtral.load_balancing_loss_func\)"
    with pytest.raises(ValueError, match=rf"cannot serve MixtralForCausalLM's router load-balancing loss {function}: "
                                         r"it is not Switch Transformer's loss.*fix: set config.output_router_logits "
                                         r"= False \(no auxiliary loss; in TRL's SFTConfig,\s+router_aux_loss_coef"):
        enable_sp_loss(_moe())
    model = _moe(router_loss=False)  # off in the config: served until a call asks for router logits
    enable_sp_loss(model)
    ids = torch.randint(0, 100, (1, 8))
    with pytest.raises(ValueError, match="computed a router load-balancing loss in an SP forward, but its function is "
                                         "not one the SP loss serves"):
        model(input_ids=ids, shift_labels=ids, output_router_logits=True)
    disable_sp_loss(model)


@pytest.mark.parametrize("loss_fn", [None, tiled_causal_lm_loss(3)], ids=["logits", "tiled"])
def test_tiled_moe_blocks_give_the_router_loss_logits_that_carry_its_gradient(loss_fn):
    """Tiled MLPs (3 tiles over 2 padded rows) with Transformers' router-logit recording served: the loss,
    the router loss and every gradient are Mixtral's own from labels; without that service each tile's router
    logits reach the loss on their own (and without a gradient), and that is refused."""
    model = _moe()
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, 10:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    own = model(input_ids=ids, attention_mask=mask, labels=labels)
    want = [g.clone() for g in torch.autograd.grad(own.loss, list(model.parameters()))]
    shift = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], dim=1)
    enable_sp_loss(model, loss_fn=loss_fn)
    tile_mlps(model, 3, router_logits_tiles())
    got = model(input_ids=ids, attention_mask=mask, shift_labels=shift)
    assert rel_err(got.loss, own.loss) <= 1e-6 and rel_err(got.aux_loss, own.aux_loss) <= 1e-6
    grads = torch.autograd.grad(got.loss, list(model.parameters()))
    assert max(rel_err(g, w, 1e-8) for g, w in zip(grads, want)) <= 1e-5
    tile_mlps(model, 3, None)
    with pytest.raises(ValueError, match="the router load-balancing loss got 8 routed tokens in a layer but an "
                                         "attention mask of 24 tokens"):
        model(input_ids=ids, attention_mask=mask, shift_labels=shift)
    untile_mlps(model)
    disable_sp_loss(model)


def test_router_logits_without_a_gradient_are_refused_naming_reentrant_checkpointing():
    """Reentrant checkpointing runs each layer without autograd in forward: Mixtral's router loss then has no
    gradient (without SP too, silently); a router loss that would train nothing is refused, naming the fix."""
    model = _moe()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    enable_sp_loss(model)
    ids = torch.randint(0, 100, (1, 8))
    with pytest.raises(ValueError, match=r"router logits reached the SP loss without a gradient.*fix: "
                                         r"gradient_checkpointing_kwargs=\{'use_reentrant': False\}"):
        model(input_ids=ids, shift_labels=ids)
    disable_sp_loss(model)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    enable_sp_loss(model)
    assert model(input_ids=ids, shift_labels=ids).aux_loss.requires_grad
    disable_sp_loss(model)


@pytest.mark.parametrize("loss_fn", [None, tiled_causal_lm_loss(3)], ids=["logits", "tiled"])
def test_trls_fused_head_trains_on_its_log_probs_with_its_fields_kept(loss_fn):
    """TRL's SFTTrainer calls the model with ``fused_lm_head=True`` (``add_fused_lm_head``: per-token
    log-probs, no logits): the SP loss is their token mean whatever loss_fn is set, gradients included, and
    TRL's per-token fields stay for its metrics."""
    from trl.trainer.utils import add_fused_lm_head

    model = tiny_model(tiny_config("cohere", logit_scale=0.5))
    ids = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    shift = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    shift[:, :4] = -100  # a prompt
    want = F.cross_entropy(model(input_ids=ids).logits.flatten(0, 1), shift.flatten(), ignore_index=-100)
    want_grads = torch.autograd.grad(want, list(model.parameters()))
    add_fused_lm_head(model, outputs=("log_probs", "is_top1"))
    enable_sp_loss(model, loss_fn=loss_fn)
    out = model(input_ids=ids, shift_labels=shift, fused_lm_head=True)
    assert out.label_mask.tolist() == (shift != -100).tolist() and out.is_top1 is not None
    assert rel_err(out.loss, want) <= 1e-6
    for got, grad in zip(torch.autograd.grad(out.loss, list(model.parameters())), want_grads):
        assert rel_err(got, grad) <= 1e-5


def test_a_fused_head_request_without_per_token_log_probs_is_refused():
    model = tiny_model(tiny_config("llama"))
    plain = model.forward
    model.forward = lambda *args, fused_lm_head=False, **kwargs: plain(*args, **kwargs)
    enable_sp_loss(model)
    ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="took fused_lm_head=True but returned CausalLMOutputWithPast without "
                                         "per-token 'log_probs' and 'label_mask'"):
        model(input_ids=ids, shift_labels=ids, fused_lm_head=True)


def test_a_forward_set_over_the_sp_loss_is_wrapped_again_when_it_is_enabled_again():
    """A second SFTTrainer on the same model adds TRL's fused head over our wrapper, and that head
    computes the shard's own loss; enabling the SP loss again (the second engine) wraps it again.
    ``grad_scale`` 2 shows whose backward ran: only the SP loss scales the gradient."""
    from trl.trainer.utils import add_fused_lm_head

    model = tiny_model(tiny_config("llama"))
    ids = torch.randint(0, 100, (1, 10), generator=torch.Generator().manual_seed(0))
    shift = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    want = torch.autograd.grad(F.cross_entropy(model(input_ids=ids).logits.flatten(0, 1), shift.flatten()),
                               model.lm_head.weight)[0]
    add_fused_lm_head(model)
    first_head = vars(model)["forward"]
    enable_sp_loss(model, grad_scale=2.0)
    add_fused_lm_head(model)  # the second trainer
    enable_sp_loss(model, grad_scale=2.0)
    wrapped = model.forward
    enable_sp_loss(model, grad_scale=2.0)  # nothing replaced it since: kept
    assert model.forward is wrapped
    loss = model(input_ids=ids, shift_labels=shift, fused_lm_head=True).loss
    assert rel_err(torch.autograd.grad(loss, model.lm_head.weight)[0], 2 * want) <= 1e-5
    disable_sp_loss(model)  # back to the forward from before the first enable
    assert vars(model)["forward"] is first_head
