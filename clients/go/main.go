// zerogap gRPC client example for Go (google.golang.org/grpc).
//
//	./build.sh && ~/.cache/zerogap/clients/go/bin/zerogap-example [host:port]
//
// build.sh generates the stubs from ../../proto into the build directory (nothing
// generated is committed). It runs: a health check, a greedy chat Generate, a
// GenerateStream printing deltas as they arrive, a JSON-schema constrained
// request, an error, a deadline, then a chat message with an image part (an 8x8 PNG; a
// text-only model answers FAILED_PRECONDITION).
package main

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"os"
	"time"

	"google.golang.org/grpc"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	pb "zerogap/v1"
)

const personSchema = `{"type": "object",
  "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
  "required": ["name", "age"], "additionalProperties": false}`

// An 8x8 red PNG: an image part carries the file's raw bytes (PNG, JPEG or WebP).
const redPNG = "iVBORw0KGgoAAAANSUhEUgAAAAgAAAAICAIAAABLbSncAAAAFUlEQVR42mM8ISfHgA0wMeAAg1MCANDKARQfGKMRAAAAAElFTkSuQmCC"

type person struct {
	Name string `json:"name"`
	Age  int    `json:"age"`
}

func greedy(maxNewTokens int32) *pb.SamplingParams {
	return &pb.SamplingParams{MaxNewTokens: proto.Int32(maxNewTokens), Temperature: proto.Float32(0)}
}

func main() {
	target := "localhost:50051"
	if len(os.Args) > 1 {
		target = os.Args[1]
	} else if env := os.Getenv("ZEROGAP_ADDR"); env != "" {
		target = env
	}
	conn, err := grpc.Dial(target,
		grpc.WithInsecure(), // plaintext (grpc-go 1.33, as Debian ships it, predates credentials/insecure)
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(64<<20)),
		grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: 30 * time.Second, Timeout: 10 * time.Second}),
	)
	if err != nil {
		log.Fatalf("dial %s: %v", target, err)
	}
	defer conn.Close()
	gen := pb.NewGenerationClient(conn)
	ctx := context.Background()

	// 1. Health check of the whole server ("" service).
	{
		ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		h, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
		if err != nil {
			log.Fatalf("health: %v", err)
		}
		fmt.Println("health:", h.GetStatus())
	}

	// 2. Chat, greedy (temperature 0).
	{
		ctx, cancel := context.WithTimeout(ctx, 120*time.Second)
		defer cancel()
		chat := &pb.ChatInput{Messages: []*pb.ChatMessage{{Role: "user", Content: "Name three colors."}}}
		r, err := gen.Generate(ctx, &pb.GenerateRequest{Input: &pb.GenerateRequest_Chat{Chat: chat}, Sampling: greedy(24)})
		if err != nil {
			log.Fatalf("generate: %v", err)
		}
		fmt.Printf("generate: %q finish=%s tokens=%d\n", r.GetText(), r.GetFinishReason(), r.GetUsage().GetCompletionTokens())
	}

	// 3. Streaming: print each delta the moment it arrives.
	{
		ctx, cancel := context.WithTimeout(ctx, 120*time.Second)
		defer cancel() // cancelling the context cancels the stream; the server frees the request
		stream, err := gen.GenerateStream(ctx, &pb.GenerateRequest{
			Input: &pb.GenerateRequest_Text{Text: "Once upon a time"}, Sampling: greedy(48)})
		if err != nil {
			log.Fatalf("stream: %v", err)
		}
		var last *pb.GenerateResponse
		for {
			delta, err := stream.Recv()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				log.Fatalf("stream: %v", err)
			}
			fmt.Printf("delta: %q\n", delta.GetText())
			last = delta
		}
		fmt.Printf("stream-done: finish=%s tokens=%d\n", last.GetFinishReason(), last.GetUsage().GetCompletionTokens())
	}

	// 4. Constrained decoding: the output validates against a JSON Schema.
	{
		ctx, cancel := context.WithTimeout(ctx, 120*time.Second)
		defer cancel()
		r, err := gen.Generate(ctx, &pb.GenerateRequest{
			Input:      &pb.GenerateRequest_Text{Text: "A person as JSON:"},
			Sampling:   greedy(48),
			Constraint: &pb.Constraint{Kind: &pb.Constraint_JsonSchema{JsonSchema: personSchema}},
		})
		if err != nil {
			log.Fatalf("json: %v", err)
		}
		var p person
		if err := json.Unmarshal([]byte(r.GetText()), &p); err != nil {
			log.Fatalf("json: %v in %q", err, r.GetText())
		}
		out, _ := json.Marshal(p)
		fmt.Println("json:", string(out))
	}

	// 5. A status error: an empty prompt is INVALID_ARGUMENT, naming the field.
	{
		ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		_, err := gen.Generate(ctx, &pb.GenerateRequest{Input: &pb.GenerateRequest_Text{Text: ""}})
		st := status.Convert(err)
		fmt.Println("error:", st.Code(), st.Message())
	}

	// 6. A deadline: a long generation with a 300 ms deadline is cut off (the server
	//    aborts the request and frees its memory).
	{
		ctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
		defer cancel()
		_, err := gen.Generate(ctx, &pb.GenerateRequest{
			Input:    &pb.GenerateRequest_Text{Text: "Count to a thousand:"},
			Sampling: &pb.SamplingParams{MaxNewTokens: proto.Int32(2000), IgnoreEos: true},
		})
		fmt.Println("deadline:", status.Code(err)) // codes.DeadlineExceeded
	}

	// 7. An image in a chat message: parts in order, text and images.
	{
		ctx, cancel := context.WithTimeout(ctx, 120*time.Second)
		defer cancel()
		png, _ := base64.StdEncoding.DecodeString(redPNG)
		parts := []*pb.ContentPart{
			{Part: &pb.ContentPart_Text{Text: "What color is this picture? "}},
			{Part: &pb.ContentPart_Image{Image: png}},
		}
		chat := &pb.ChatInput{Messages: []*pb.ChatMessage{{Role: "user", Parts: parts}}}
		r, err := gen.Generate(ctx, &pb.GenerateRequest{Input: &pb.GenerateRequest_Chat{Chat: chat}, Sampling: greedy(8)})
		if err != nil {
			st := status.Convert(err)
			fmt.Println("image:", st.Code(), st.Message())
		} else {
			out, _ := json.Marshal(r.Text)
			fmt.Println("image: OK", string(out))
		}
	}
}
