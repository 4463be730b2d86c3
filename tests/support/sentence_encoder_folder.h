// Writes small sentence-transformers folders (config.json, vocab.txt, model.safetensors, the
// pooling and normalisation modules) with seeded random weights, for the encoder's tests, and the
// safetensors bytes alone for the reader's.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace kallpa::testing {

struct SafetensorsEntry {
  std::string dtype = "F32";
  std::vector<std::int64_t> shape;
  std::string bytes;
};

// The file's bytes: the 8-byte little-endian header length, the JSON header, the data in name order.
std::string safetensors_bytes(const std::map<std::string, SafetensorsEntry>& tensors);

struct EncoderFolderOptions {
  int hidden = 16, layers = 2, heads = 4, intermediate = 32, max_positions = 64;
  std::uint64_t seed = 1;
  std::string drop_tensor;       // leave this tensor out
  std::string misshape_tensor;   // give this one a wrong shape
  std::string pooling = "mean";  // "mean", "cls" or "max" (unsupported)
  bool prefix_bert = false;      // names as BertForX writes them ("bert.embeddings...")
};

// The vocabulary: [PAD] [UNK] [CLS] [SEP] [MASK], the letters, a few words and "##" pieces.
std::vector<std::string> encoder_vocabulary();

// Writes the folder at `dir` (created), returns `dir`.
std::string write_encoder_folder(const std::string& dir, const EncoderFolderOptions& options = {});

}  // namespace kallpa::testing
