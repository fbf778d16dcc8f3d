/*
 * The parity test's way into llama.cpp: one call that loads a GGUF model,
 * optionally a GGUF LoRA adapter, evaluates token ids in one batch and copies
 * out the logits of every position. Compiled against the same release's
 * llama.h and called through ctypes: llama.h passes its parameter structs by
 * value, and their layout changes between releases, so mirroring them in
 * ctypes would be the fragile part.
 */
#include <stdio.h>
#include <string.h>

#include "llama.h"

static void quiet(enum ggml_log_level level, const char * text, void * user_data) {
    (void) user_data;
    if (level == GGML_LOG_LEVEL_ERROR) {
        fputs(text, stderr);
    }
}

/*
 * Answers n_vocab (logits written: n_tokens * n_vocab floats into out), or
 * -1 model not loaded, -2 context not made, -3 adapter not loaded,
 * -4 adapter not set, -5 out too small, -6 decode failed.
 */
int lf_eval(const char * model_path, const char * adapter_path, float scale,
            const int32_t * tokens, int32_t n_tokens, float * out, int64_t out_len) {
    static int ready = 0;
    if (!ready) {
        llama_log_set(quiet, NULL);
        llama_backend_init();
        ready = 1;
    }
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    struct llama_model * model = llama_model_load_from_file(model_path, mp);
    if (model == NULL) {
        return -1;
    }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 256;
    cp.n_batch = 256;
    cp.n_ubatch = 256;
    cp.n_threads = 1;
    cp.n_threads_batch = 1;
    /* An f16 cache would round keys and values; the comparison is with f32. */
    cp.type_k = GGML_TYPE_F32;
    cp.type_v = GGML_TYPE_F32;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    struct llama_context * ctx = llama_init_from_model(model, cp);
    int rc = 0;
    struct llama_adapter_lora * adapter = NULL;
    struct llama_batch batch = llama_batch_init(n_tokens, 0, 1);
    if (ctx == NULL) {
        rc = -2;
        goto done;
    }
    if (adapter_path != NULL) {
        adapter = llama_adapter_lora_init(model, adapter_path);
        if (adapter == NULL) {
            rc = -3;
            goto done;
        }
        if (llama_set_adapters_lora(ctx, &adapter, 1, &scale) != 0) {
            rc = -4;
            goto done;
        }
    }
    const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    if ((int64_t) n_vocab * n_tokens > out_len) {
        rc = -5;
        goto done;
    }
    for (int32_t i = 0; i < n_tokens; i++) {
        batch.token[i] = tokens[i];
        batch.pos[i] = i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = 1;
    }
    batch.n_tokens = n_tokens;
    if (llama_decode(ctx, batch) != 0) {
        rc = -6;
        goto done;
    }
    for (int32_t i = 0; i < n_tokens; i++) {
        memcpy(out + (int64_t) i * n_vocab, llama_get_logits_ith(ctx, i), sizeof(float) * n_vocab);
    }
    rc = n_vocab;
done:
    llama_batch_free(batch);
    if (ctx != NULL) {
        llama_free(ctx);
    }
    if (adapter != NULL) {
        llama_adapter_lora_free(adapter);
    }
    llama_model_free(model);
    return rc;
}
