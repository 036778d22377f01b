// zerogap gRPC client example for C++ (grpc++).
//
//   cmake -S . -B build && cmake --build build -j2 && build/zerogap-example [host:port]
//
// CMake generates the stubs from ../../proto into the build directory (nothing
// generated is committed). It runs: a health check, a greedy chat Generate, a
// GenerateStream printing deltas as they arrive, a JSON-schema constrained
// request, an error, a deadline, then a chat message with an image part (an 8x8 PNG; a
// text-only model answers FAILED_PRECONDITION).
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <string>

#include <grpcpp/grpcpp.h>

#include "grpc/health/v1/health.grpc.pb.h"
#include "zerogap/v1/generation.grpc.pb.h"

// An 8x8 red PNG: an image part carries the file's raw bytes (PNG, JPEG or WebP).
static const unsigned char kRedPng[] = {
    0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a, 0x00, 0x00, 0x00, 0x0d,
    0x49, 0x48, 0x44, 0x52, 0x00, 0x00, 0x00, 0x08, 0x00, 0x00, 0x00, 0x08,
    0x08, 0x02, 0x00, 0x00, 0x00, 0x4b, 0x6d, 0x29, 0xdc, 0x00, 0x00, 0x00,
    0x15, 0x49, 0x44, 0x41, 0x54, 0x78, 0xda, 0x63, 0x3c, 0x21, 0x27, 0xc7,
    0x80, 0x0d, 0x30, 0x31, 0xe0, 0x00, 0x83, 0x53, 0x02, 0x00, 0xd0, 0xca,
    0x01, 0x14, 0x1f, 0x18, 0xa3, 0x11, 0x00, 0x00, 0x00, 0x00, 0x49, 0x45,
    0x4e, 0x44, 0xae, 0x42, 0x60, 0x82,
};

namespace {

using grpc::ClientContext;
using grpc::Status;
using zerogap::v1::FinishReason_Name;
using zerogap::v1::GenerateRequest;
using zerogap::v1::GenerateResponse;
using zerogap::v1::Generation;

const char* kPersonSchema =
    R"({"type": "object",
        "properties": {"name": {"type": "string", "maxLength": 16},
                       "age": {"type": "integer", "minimum": 0, "maximum": 150}},
        "required": ["name", "age"], "additionalProperties": false})";

// The canonical name of a status code, e.g. INVALID_ARGUMENT.
std::string CodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK: return "OK";
    case grpc::StatusCode::CANCELLED: return "CANCELLED";
    case grpc::StatusCode::INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND: return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS: return "ALREADY_EXISTS";
    case grpc::StatusCode::RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION: return "FAILED_PRECONDITION";
    case grpc::StatusCode::OUT_OF_RANGE: return "OUT_OF_RANGE";
    case grpc::StatusCode::INTERNAL: return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE: return "UNAVAILABLE";
    default: return "CODE_" + std::to_string(static_cast<int>(code));
  }
}

// The text on one line, newlines escaped.
std::string OneLine(const std::string& text) {
  std::string out;
  for (char c : text) out += c == '\n' ? std::string("\\n") : std::string(1, c);
  return out;
}

// A context whose call fails with DEADLINE_EXCEEDED after `timeout`.
std::unique_ptr<ClientContext> WithDeadline(std::chrono::milliseconds timeout) {
  auto ctx = std::make_unique<ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() + timeout);
  return ctx;
}

void Greedy(GenerateRequest* req, int max_new_tokens) {
  req->mutable_sampling()->set_max_new_tokens(max_new_tokens);
  req->mutable_sampling()->set_temperature(0.0f);
}

int Fail(const char* what, const Status& s) {
  std::cerr << what << ": " << CodeName(s.error_code()) << " " << s.error_message() << std::endl;
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  const char* env = std::getenv("ZEROGAP_ADDR");
  std::string target = argc > 1 ? argv[1] : (env ? env : "localhost:50051");
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 30000);
  auto channel = grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
  auto gen = Generation::NewStub(channel);
  using std::chrono::milliseconds;

  // 1. Health check of the whole server ("" service).
  {
    auto health = grpc::health::v1::Health::NewStub(channel);
    grpc::health::v1::HealthCheckRequest req;
    grpc::health::v1::HealthCheckResponse resp;
    auto ctx = WithDeadline(milliseconds(5000));
    Status s = health->Check(ctx.get(), req, &resp);
    if (!s.ok()) return Fail("health", s);
    std::cout << "health: " << grpc::health::v1::HealthCheckResponse::ServingStatus_Name(resp.status()) << std::endl;
  }

  // 2. Chat, greedy (temperature 0).
  {
    GenerateRequest req;
    auto* msg = req.mutable_chat()->add_messages();
    msg->set_role("user");
    msg->set_content("Name three colors.");
    Greedy(&req, 24);
    GenerateResponse resp;
    auto ctx = WithDeadline(milliseconds(120000));
    Status s = gen->Generate(ctx.get(), req, &resp);
    if (!s.ok()) return Fail("generate", s);
    std::cout << "generate: " << OneLine(resp.text()) << " finish=" << FinishReason_Name(resp.finish_reason())
              << " tokens=" << resp.usage().completion_tokens() << std::endl;
  }

  // 3. Streaming: print each delta the moment it arrives (flushed per line).
  {
    GenerateRequest req;
    req.set_text("Once upon a time");
    Greedy(&req, 48);
    auto ctx = WithDeadline(milliseconds(120000));
    auto reader = gen->GenerateStream(ctx.get(), req);
    GenerateResponse delta, last;
    while (reader->Read(&delta)) {
      std::cout << "delta: " << OneLine(delta.text()) << std::endl;
      last = delta;
    }
    Status s = reader->Finish();
    if (!s.ok()) return Fail("stream", s);
    std::cout << "stream-done: finish=" << FinishReason_Name(last.finish_reason())
              << " tokens=" << last.usage().completion_tokens() << std::endl;
  }

  // 4. Constrained decoding: the output validates against a JSON Schema.
  {
    GenerateRequest req;
    req.set_text("A person as JSON:");
    Greedy(&req, 48);
    req.mutable_constraint()->set_json_schema(kPersonSchema);
    GenerateResponse resp;
    auto ctx = WithDeadline(milliseconds(120000));
    Status s = gen->Generate(ctx.get(), req, &resp);
    if (!s.ok()) return Fail("json", s);
    std::cout << "json: " << resp.text() << std::endl;
  }

  // 5. A status error: an empty prompt is INVALID_ARGUMENT, naming the field.
  {
    GenerateRequest req;
    req.set_text("");
    GenerateResponse resp;
    auto ctx = WithDeadline(milliseconds(10000));
    Status s = gen->Generate(ctx.get(), req, &resp);
    std::cout << "error: " << CodeName(s.error_code()) << " " << s.error_message() << std::endl;
  }

  // 6. A deadline: a long generation with a 300 ms deadline is cut off (the server
  //    aborts the request and frees its memory).
  {
    GenerateRequest req;
    req.set_text("Count to a thousand:");
    req.mutable_sampling()->set_max_new_tokens(2000);
    req.mutable_sampling()->set_ignore_eos(true);
    GenerateResponse resp;
    auto ctx = WithDeadline(milliseconds(300));
    Status s = gen->Generate(ctx.get(), req, &resp);
    std::cout << "deadline: " << CodeName(s.error_code()) << std::endl;
  }

  // 7. An image in a chat message: parts in order, text and images.
  {
    GenerateRequest req;
    auto* msg = req.mutable_chat()->add_messages();
    msg->set_role("user");
    msg->add_parts()->set_text("What color is this picture? ");
    msg->add_parts()->set_image(std::string(reinterpret_cast<const char*>(kRedPng), sizeof(kRedPng)));
    Greedy(&req, 8);
    GenerateResponse resp;
    auto ctx = WithDeadline(milliseconds(120000));
    Status s = gen->Generate(ctx.get(), req, &resp);
    if (s.ok()) {
      std::cout << "image: OK " << OneLine(resp.text()) << std::endl;
    } else {
      std::cout << "image: " << CodeName(s.error_code()) << " " << s.error_message() << std::endl;
    }
  }
  return 0;
}
