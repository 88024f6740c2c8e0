"""Export drafter checkpoints for serving engines, and import public drafters.

``draftlab export CKPT --to ENGINE OUT [--target default]`` and
``draftlab import SRC --format NAME --target default OUT``.
API: ``exporter.export_checkpoint(ckpt, engine, out, target, opts, overwrite)`` and
``importer.import_checkpoint(src, format_name, out, target, overwrite)``.

One small mapping per (algorithm, layout), each module registering its own formats with
``formats.register`` (engines and import names are whatever the registered formats declare):

=========  ========  ==============================================================  ===============
``--to``   drafter   layout written                                                  module
=========  ========  ==============================================================  ===============
vllm       eagle3    speculators ``Eagle3Speculator`` (vLLM ``Eagle3LlamaForCausalLM``)  eagle3_speculators.py
sglang     eagle3    SGLang ``LlamaForCausalLMEagle3`` (SpecForge layout)            eagle3_sglang.py
sglang     eagle1    EAGLE repo layout, ``LlamaForCausalLMEagle`` (fc with bias)     eagle1.py
vllm       eagle1    EAGLE repo layout, ``LlamaForCausalLM`` (fc without bias)        eagle1.py
vllm       medusa    vLLM ``MedusaModel`` (``blocks.*``, ``lm_heads.*``, ``token_map``)    medusa.py
medusa     medusa    FasterDecoding ``medusa_lm_head.safetensors`` / ``.pt`` (TRT-LLM)   medusa.py
vllm       medusa2   the heads as vLLM ``MedusaModel``, beside the merged target       medusa2.py
vllm       diffusion speculators ``dflash`` (``DFlashDraftModel``; vLLM ``"dflash"``)      dflash.py
vllm       peagle    speculators ``peagle`` (``PEagleDraftModel``; vLLM detects P-EAGLE)  peagle_speculators.py
sglang     diffusion z-lab ``DFlashDraftModel`` (SGLang ``DFLASH``, SpecForge); full vocab  dflash.py
hf         any       draftlab checkpoint + config.json (what ``draftlab eval`` reads)  draftlab_layout.py
=========  ========  ==============================================================  ===============

Every export refuses a checkpoint trained for another target (``draftlab.checkpoint.check_target``),
refuses drafters the layout cannot hold exactly (each refusal names the reason), is written
atomically and carries a model card (``model_card.py``) whose numbers come only from the
checkpoint's measured ``metrics.eval``. Imports are the inverse mappings and fail on any
missing or unknown tensor, listing the names. Both apply the checkpoint validation
(``draftlab.checkpoint.check_drafter``: the family's ``Meta`` schema and its vocabulary maps)
before writing anything, so neither writes what loading would refuse.

Aux-layer indices: draftlab's ``aux_layers``, speculators' and vLLM's
``eagle_aux_hidden_state_layer_ids`` are HF ``hidden_states`` indices (the input of decoder
layer i); SGLang/SpecForge ids are one lower (SGLang captures id+1). See ``eagle3_speculators.py``
and ``eagle3_sglang.py``.

Which loaders are covered
-------------------------
Proven by loading (``tests/test_export.py``; the peer's own model class built from the exported
``config.json``, exported tensor names compared both ways with its ``state_dict()``, weights
loaded with ``strict=True``, outputs compared with draftlab's in fp32 to 1e-5, TTT steps
included for EAGLE-3):

* speculators 0.9.0 ``Eagle3DraftModel`` — the ``--to vllm`` EAGLE-3 files (Llama and
  Qwen2-style layers, multi-layer, llama3 RoPE scaling);
* SpecForge 0.2.0 ``LlamaForCausalLMEagle3`` — the ``--to sglang`` EAGLE-3 files;
* eagle-llm 1.2.1 (the EAGLE repository's ``cnets.Model``) — both EAGLE-1 exports;
* speculators 0.9.0 ``DFlashDraftModel`` (``from_pretrained`` of the ``--to vllm`` files) and
  SpecForge 0.2.0's z-lab ``DFlashDraftModel`` (the ``--to sglang`` files): block logits equal
  draftlab's (``tests/test_diffusion_export.py``);
* round trips export -> import give bit-identical drafters for every format.

Not run (no CUDA builds of the engines on a CPU machine); the facts used were read from their
loaders and are cited in each mapping module: vLLM's speculators config adapter
(``transformers_utils/configs/speculators``), ``llama_eagle3.py`` / ``llama_eagle.py`` weight
loading and its aux-state capture in ``llama.py``; SGLang's ``llama_eagle3.py`` /
``llama_eagle.py`` and ``set_eagle3_layers_to_capture``. Known engine limits, enforced as
refusals: vLLM's EAGLE-1 fc has no bias; SGLang's extra EAGLE-3 layers lose the residual (1-layer
only); neither engine's Llama drafter layer has q/k RMSNorm (Qwen3-family drafters); aux states
can be captured at decoder-layer inputs 1..L-1 only. vLLM and SGLang could change any of this:
re-check their loaders when they move.

CI installs the peers without their dependency pins (speculators pins transformers<=5.19,
SpecForge pins torch 2.11 / sglang, eagle-llm pins accelerate 0.21); only their model code is used::

    pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0 specforge==0.2.0 eagle-llm==1.2.1 medusa-llm==0.1
    pip install -c scripts/constraints.txt loguru pydantic-settings openai aiohttp
"""
