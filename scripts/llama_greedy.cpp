// Greedy continuation of a token-id prompt through llama.cpp's library, one token id and its top-2 logit margin per
// line: what scripts/bench_llamacpp.py compares with dsfp4's (llama-simple prints text only, and a byte-level
// tokenizer's pieces need not be text). Usage: llama_greedy MODEL.gguf N_TOKENS N_GPU_LAYERS ID...
// N_TOKENS given as rows:K: the last K ids are fed, not chosen, and each step prints its whole logits row instead.
// Built with -DIK_LLAMA against ik_llama.cpp, which keeps llama.cpp's older API for a batch and for freeing a model.
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "llama.h"

#ifdef IK_LLAMA
// ik's batch names its first position: the tokens after the prompt go at pos
static llama_batch batch_at(llama_token * tokens, int32_t n, llama_pos pos) {
    return llama_batch_get_one(tokens, n, pos, 0);
}
static void free_model(llama_model * model) { llama_free_model(model); }
#else
// mainline's context places a batch after what it holds
static llama_batch batch_at(llama_token * tokens, int32_t n, llama_pos) { return llama_batch_get_one(tokens, n); }
static void free_model(llama_model * model) { llama_model_free(model); }
#endif

int main(int argc, char ** argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s MODEL.gguf N_TOKENS N_GPU_LAYERS ID...\n", argv[0]);
        return 2;
    }
    const bool rows = argv[2][0] == 'r';  // rows:K
    const int n_forced = rows ? atoi(argv[2] + 5) : 0;
    std::vector<llama_token> prompt;
    for (int i = 4; i < argc; i++) {
        prompt.push_back(atoi(argv[i]));
    }
    const std::vector<llama_token> forced(prompt.end() - n_forced, prompt.end());
    prompt.resize(prompt.size() - n_forced);
    const int n_new = rows ? n_forced + 1 : atoi(argv[2]);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = atoi(argv[3]);
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (model == nullptr) {
        return 1;
    }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = cp.n_batch = (uint32_t) (prompt.size() + n_new + 8);
    llama_context * ctx = llama_init_from_model(model, cp);
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    llama_batch batch = batch_at(prompt.data(), (int32_t) prompt.size(), 0);
    llama_token next = 0;
    auto pos = (llama_pos) prompt.size();
    for (int step = 0; step < n_new; step++, pos++) {
        if (llama_decode(ctx, batch) != 0) {
            return 1;
        }
        const float * logits = llama_get_logits_ith(ctx, -1);
        if (rows) {
            for (int j = 0; j < n_vocab; j++) {
                printf(j ? " %.6f" : "%.6f", logits[j]);
            }
            printf("\n");
            if (step == n_forced) {
                break;
            }
            next = forced[step];
            batch = batch_at(&next, 1, pos);
            continue;
        }
        int best = 0, second = 1;
        if (logits[second] > logits[best]) {
            best = 1, second = 0;
        }
        for (int j = 2; j < n_vocab; j++) {
            if (logits[j] > logits[best]) {
                second = best, best = j;
            } else if (logits[j] > logits[second]) {
                second = j;
            }
        }
        printf("%d %.6f\n", best, logits[best] - logits[second]);
        next = best;
        batch = batch_at(&next, 1, pos);
    }
    llama_free(ctx);
    free_model(model);
    return 0;
}
