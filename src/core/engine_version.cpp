// Anchors the engine library so it links even before its layers have sources of their own.
namespace kallpa {
extern const char* const kEngineVersion;
const char* const kEngineVersion = "0.1.0";
}  // namespace kallpa
